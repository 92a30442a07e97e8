"""Edge mode's disk tier in the simulator: routed experts stay in the model file,
resident ones live in a RAM slot pool, and every copy is a read of the file.

The rules are libspice's, each modelled from its C original:

- what a read is (spice-device-disk.c, read_copy): an expert is read as its
  three matrices, one pread each, at file_offset[k] + e * stride[k]; with
  O_DIRECT every read is widened to DISK_ALIGN (4096) at both ends and the
  widened bytes are what is counted (a read past the end of the file stops
  there). `ExpertReads` holds the reads and widened bytes of every expert, taken
  from the model file's own header as bind_file_offsets takes them;
- who reads (reader_main, take_next): READERS (4) reader threads with their own
  queue, taken highest priority first, then in the order handed over; a read
  that started runs to its end;
- what the store hands over (disk_can_start, disk_issue on a real clock): copies
  start while fewer than 2 x READERS of them are started and not yet landed; a
  started copy can no longer be overtaken or cancelled, so its read is made (and
  counted) whatever happens to its expert later. The start and end a started
  copy reports -- what ready_at and the policies see -- are the device's
  estimate, start = max(bus_free, now), end = start + latency + bytes /
  bandwidth, bus_free = start + bytes / bandwidth (reads overlap their latency),
  from the figures the engine gives the store (`pyspice probe`'s);
- when a copy is resident (disk_poll, disk_wait): at the first poll (one per
  hook call) or wait after its read is done; copy_ns is the read's own time;
- host actions (spice-runtime-host-read.c): after the plan is applied (its
  device experts waited for), every expert the call runs on the host that got
  no slot in this call -- whether or not the tier holds it -- is read into
  scratch for this call only, at priority demand + 1 (ahead of every queued
  read), and the call waits for those reads; nothing of it stays resident;
- the device does not compute: the host executor runs resident experts from
  their slots and scratch experts from scratch, so device work is host work
  (Costs.device_shares_host).

The disk itself is hardware, not C. It is modelled from the two figures
`pyspice probe` measures (pyspice.engine.disk_probe): bandwidth with READERS
expert-sized direct reads in flight, and the median time of one random 64 KiB
direct read. Transfers share the bandwidth one after another; each read also
takes a fixed latency that overlaps other reads' transfers: a read a reader
starts at s moves its bytes from x = max(s, disk free) to x + bytes / bandwidth
and is done `read_latency_us` later. The probe's 64 KiB read includes its own
transfer, so the fixed part is that read's time less 64 KiB / bandwidth: one
lone 64 KiB read then takes what the probe measured, and READERS readers
together reach its bandwidth. (The store's estimates use the probe's latency
as a whole, as the engine gives it: they are estimates, as in C.)

The disk shares the host's cores with the decode (DiskRules' last three
fields). Each expert is three preads made by a reader thread, which sleeps
while the disk works and needs a core again to issue the next matrix's pread,
copy the matrix out of its aligned buffer and hand the expert over; ggml's
compute threads hold every core while the decode computes and wait for each
other at every op. On a machine with few cores, then, a read moves at full
speed only while the decode waits for the disk, and it can cost the compute
some of its time. Three terms say how much:

- `overlap` in [0, 1]: the share of the disk's progress that goes on while the
  host computes. The reader pool runs on a clock of its own (`DiskClock`) that
  moves at `overlap` x the host's rate while the host computes and at the
  host's rate while the host waits for a read: 1 hides a prefetch's read
  behind compute as a GPU's copy engine would (the pricing without the term,
  exactly); 0 serialises every read with compute, a read then moving only
  while the decode waits, so a prefetch saves only what reads waited for
  together save.
- `host_read_us`: the host compute lost per pread that completes while the
  host computes (the reader's wake-up, copy and hand-over take a core from a
  compute thread, and the op's other threads wait for that one at the
  barrier). Per read, not per byte: with O_DIRECT the disk moves the bytes
  and the host's share is per call. (Every expert read here is three preads
  of about its size, so per read and per byte cannot be told apart on one
  model's records.) The lost time is paid before the next call's host reads
  (SimDiskTier.read_for_host), as compute, so the call that follows starts
  that much later.
- `read_scale`: how many times the probe's time a read takes while a decode
  runs, even while the decode waits (the probe times the disk on idle cores;
  during a decode the reader threads queue for a core to issue each pread).
  On a shared machine it also carries how far the disk's speed has moved
  since the probe.

None of them is measurable on the disk alone; they are fitted to edge-mode
bench records (pyspice.sim.fit_disk).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pyspice.formats.model_info import EXPERT_TENSOR, read_header
from pyspice.sim.tier import PRIORITY_DEMAND, Copy, SimTier

DISK_ALIGN = 4096  # spice-device-disk.c: O_DIRECT alignment of offsets, lengths and buffers
READERS = 4  # DISK_THREADS_DEFAULT: reader threads of the disk device
PROBE_READ_BYTES = 64 * 1024  # pyspice.engine.disk_probe.LATENCY_READ: the read its latency times
PRIORITY_HOST_READ = PRIORITY_DEMAND + 1  # disk_host_read: ahead of every copy into a slot


def widened(offset: int, length: int, file_size: int | None = None, align: int = DISK_ALIGN) -> int:
    """Bytes one O_DIRECT read of [offset, offset + length) reads: the range widened to
    `align` at both ends, cut at the end of the file (pread returns short there)."""
    lo = offset // align * align
    hi = (offset + length + align - 1) // align * align
    if file_size is not None:
        hi = min(hi, max(file_size, offset + length))
    return hi - lo


def direct_io(path: Path) -> bool:
    """Whether the file system takes O_DIRECT for `path`, as disk_create finds out (it
    opens with O_DIRECT and falls back to the page cache, unwidened, on EINVAL)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return False
    os.close(fd)
    return True


@dataclass(frozen=True)
class ExpertReads:
    """Per layer and expert: (reads, widened bytes) of reading that expert from the file.
    Layers without routed experts have no entries."""

    per_layer: tuple[tuple[tuple[int, int], ...], ...]

    def of(self, layer: int, expert: int) -> tuple[int, int]:
        return self.per_layer[layer][expert]

    def bytes_of(self, layer: int, expert: int) -> int:
        return self.per_layer[layer][expert][1]

    @staticmethod
    def from_model(path: Path, direct: bool | None = None) -> ExpertReads:
        """From the GGUF header, as bind_file_offsets and spice_store_expert_copy place
        an expert: matrix k of expert e at data offset + tensor offset + e * (tensor
        bytes / n_expert), that many bytes, widened where O_DIRECT is in effect (`direct`;
        None: as the file system allows, direct_io)."""
        align = DISK_ALIGN if (direct_io(path) if direct is None else direct) else 1
        header = read_header(path)
        n_layers = 0
        mats: dict[int, list[tuple[int, int, int]]] = {}  # layer -> [(offset, stride, n_expert)]
        for t in header.tensors:
            m = EXPERT_TENSOR.match(t.name)
            if m is None:
                continue
            il = int(m.group(1))
            n_layers = max(n_layers, il + 1)
            n_expert = int(t.shape[-1])
            mats.setdefault(il, []).append((header.data_offset + t.offset, t.nbytes // n_expert, n_expert))
        block_count = header.metadata.get(f"{header.metadata.get('general.architecture')}.block_count")
        if isinstance(block_count, int):
            n_layers = max(n_layers, block_count)
        per_layer: list[tuple[tuple[int, int], ...]] = []
        for il in range(n_layers):
            layer = mats.get(il, [])
            n_expert = min((n for _, _, n in layer), default=0)
            per_layer.append(
                tuple(
                    (
                        len(layer),
                        sum(
                            widened(off + e * stride, stride, header.file_size, align)
                            for off, stride, _ in layer
                        ),
                    )
                    for e in range(n_expert)
                )
            )
        return ExpertReads(tuple(per_layer))

    @staticmethod
    def unaligned(n_expert: Sequence[int], expert_bytes: Sequence[int], reads: int = 3) -> ExpertReads:
        """Every expert as `reads` reads of its own bytes, nothing widened (tests; a file
        system without O_DIRECT)."""
        return ExpertReads(
            tuple(((reads, int(b)),) * int(n) for n, b in zip(n_expert, expert_bytes, strict=True))
        )


@dataclass(frozen=True)
class DiskRules:
    """What makes a simulated tier the disk tier (Costs.disk)."""

    reads: ExpertReads
    read_latency_us: float  # the disk's fixed latency per read (module docstring)
    readers: int = READERS
    # the disk and the decode on the same cores (module docstring): the share of the disk's
    # progress that goes on while the host computes, and host compute lost per pread then
    overlap: float = 1.0
    host_read_us: float = 0.0
    # how many times the probe's time a read takes while a decode runs, even while it waits
    read_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0 or self.host_read_us < 0 or not self.read_scale > 0:
            raise ValueError(
                f"disk overlap must be in [0, 1], host time per read non-negative and the read "
                f"scale positive (got {self.overlap}, {self.host_read_us}, {self.read_scale})"
            )

    @staticmethod
    def fixed_latency_us(probe_latency_us: float, gbps: float) -> float:
        """The fixed part of the probe's 64 KiB read time: less that read's own transfer."""
        return max(0.0, probe_latency_us - PROBE_READ_BYTES / (gbps * 1e3))


@dataclass
class DiskClock:
    """The reader pool's clock against the host's: piecewise linear, moving at `overlap`
    x the host's rate while the host computes and at its rate while the host waits for
    a read (module docstring). Both start at 0; `host` and `disk` are its breakpoints."""

    overlap: float = 1.0
    host: list[int] = field(default_factory=lambda: [0])
    disk: list[int] = field(default_factory=lambda: [0])

    @property
    def host_ns(self) -> int:
        return self.host[-1]

    @property
    def disk_ns(self) -> int:
        return self.disk[-1]

    def _extend(self, host_ns: int, disk_ns: int) -> None:
        # a segment as steep as the last one extends it (overlap 1 keeps a single segment)
        if len(self.host) >= 2:
            dh, dd = self.host[-1] - self.host[-2], self.disk[-1] - self.disk[-2]
            if dd * (host_ns - self.host[-1]) == dh * (disk_ns - self.disk[-1]):
                self.host[-1], self.disk[-1] = host_ns, disk_ns
                return
        self.host.append(host_ns)
        self.disk.append(disk_ns)

    def compute_to(self, host_ns: int) -> int:
        """The host computed from the clock's last time to `host_ns`; the disk's time then
        (an earlier host time: the disk's time it had then)."""
        if host_ns <= self.host_ns:
            return self.disk_of(host_ns)
        step = host_ns - self.host_ns
        moved = step if self.overlap >= 1.0 else int(step * self.overlap)
        self._extend(host_ns, self.disk_ns + moved)
        return self.disk_ns

    def wait_for(self, disk_ns: int) -> int:
        """The host waits from the clock's last time until the disk's time is `disk_ns`;
        the host's time then (one already past: the earliest host time it was reached)."""
        if disk_ns <= self.disk_ns:
            return self.host_of(disk_ns)
        self._extend(self.host_ns + disk_ns - self.disk_ns, disk_ns)
        return self.host_ns

    def disk_of(self, host_ns: int) -> int:
        """The disk's time at host time `host_ns` (beyond the clock's last time: as if the
        host waited until then)."""
        if host_ns >= self.host_ns:
            return self.disk_ns + (host_ns - self.host_ns)
        i = bisect.bisect_right(self.host, host_ns)
        if i == 0:
            return self.disk[0]
        h0, h1, d0, d1 = self.host[i - 1], self.host[i], self.disk[i - 1], self.disk[i]
        return d0 + (d1 - d0) * (host_ns - h0) // max(1, h1 - h0)

    def host_of(self, disk_ns: int) -> int:
        """The earliest host time at which the disk's time was `disk_ns` (beyond the
        clock's last time: as if the host waited until then)."""
        if disk_ns >= self.disk_ns:
            return self.host_ns + (disk_ns - self.disk_ns)
        i = bisect.bisect_left(self.disk, disk_ns)
        if i == 0:
            return self.host[0]
        h0, h1, d0, d1 = self.host[i - 1], self.host[i], self.disk[i - 1], self.disk[i]
        return h0 + -(-(h1 - h0) * (disk_ns - d0) // max(1, d1 - d0))


@dataclass
class Read:
    nbytes: int  # widened
    n_reads: int
    priority: int
    seq: int
    handed_ns: int
    scratch: bool  # a host action's read into scratch (else a copy into a slot)
    # on the disk's clock (DiskClock): when a reader took it, when it is done
    start_ns: int = -1
    done_ns: int = -1
    handed_host_ns: int = 0  # when it was handed over, on the host's clock


@dataclass
class DiskDevice:
    """The disk device's reader pool and the disk, on a clock of their own (DiskClock:
    the host's, where `overlap` is 1). Reads are handed over at the caller's `now` (host
    time); readers free by then take them in queue order (take_next) as the clock moves
    on. Every time a Read holds is on the disk's clock; what the device answers is in
    host time."""

    gbps: float
    latency_us: float  # fixed, per read
    readers: int = READERS
    overlap: float = 1.0  # DiskRules.overlap
    host_read_us: float = 0.0  # DiskRules.host_read_us
    free_ns: list[int] = field(default_factory=list)
    disk_free_ns: int = 0
    queue: list[Read] = field(default_factory=list)
    log: list[Read] = field(default_factory=list)  # every read handed over, in order
    clock: DiskClock = field(default_factory=DiskClock)
    host_lost_ns: float = 0.0  # host compute lost to reads done while it computed, not yet paid
    _pending: list[Read] = field(default_factory=list)  # started, not yet done on the host's clock
    _seq: int = 0

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.latency_us < 0 or self.readers < 1:
            raise ValueError("disk bandwidth must be positive, latency non-negative, readers at least 1")
        if not 0.0 <= self.overlap <= 1.0 or self.host_read_us < 0:
            raise ValueError("disk overlap must be in [0, 1] and host time per read non-negative")
        self.free_ns = [0] * self.readers
        self.clock = DiskClock(self.overlap)

    def submit(self, nbytes: int, n_reads: int, priority: int, now: int, *, scratch: bool = False) -> Read:
        self.advance(now)
        self._seq += 1
        r = Read(nbytes, n_reads, priority, self._seq, self.clock.disk_of(now), scratch, handed_host_ns=now)
        self.queue.append(r)
        self.log.append(r)
        self._run(r.handed_ns)  # a reader free now takes it at once
        return r

    def advance(self, now: int) -> None:
        """The host computed until `now`: the disk moved on as far as that takes it (its
        clock, `overlap` x as far), and the readers free by then took the queued reads
        they would have taken."""
        before = self.clock.disk_ns
        self._run(self.clock.compute_to(now))
        self._settle(before, self.clock.disk_ns, computing=True)

    def _run(self, until: int) -> None:
        """Readers free by disk time `until` take the queued reads they would have taken."""
        while self.queue:
            i = min(range(self.readers), key=self.free_ns.__getitem__)
            t = max(self.free_ns[i], min(r.handed_ns for r in self.queue))
            if t > until:
                return
            ready = [r for r in self.queue if r.handed_ns <= t]
            r = min(ready, key=lambda q: (-q.priority, q.seq))
            self.queue.remove(r)
            x = max(t, self.disk_free_ns)
            transfer = int(r.nbytes / self.gbps)
            self.disk_free_ns = x + transfer
            r.start_ns = t
            r.done_ns = x + transfer + round(self.latency_us * 1e3)
            self.free_ns[i] = r.done_ns
            self._pending.append(r)

    def _settle(self, lo: int, hi: int, *, computing: bool) -> None:
        """The reads done within disk time (lo, hi]: while the host computed, each of their
        preads cost it host_read_us."""
        if not self._pending:
            return
        done = [r for r in self._pending if r.done_ns <= hi]
        if not done:
            return
        self._pending = [r for r in self._pending if r.done_ns > hi]
        if computing and self.host_read_us > 0:
            self.host_lost_ns += sum(r.n_reads for r in done if r.done_ns > lo) * self.host_read_us * 1e3

    def finish(self, r: Read, now: int | None = None) -> int:
        """When `r` is done, in host time, for a host that waits for it from `now` (None:
        the clock's last time); the readers move on as far as that takes (nothing else is
        handed over meanwhile: the caller waits)."""
        if now is not None:
            self.advance(now)
        while r.done_ns < 0:
            self._run(max(min(self.free_ns), min(q.handed_ns for q in self.queue)))
        before = self.clock.disk_ns
        done = self.clock.wait_for(r.done_ns)
        self._settle(before, self.clock.disk_ns, computing=False)
        return done

    def host_ns(self, r: Read) -> tuple[int, int]:
        """(start, done) of a started read in host time. A disk time the clock held while
        the host computed maps to the earliest host time it had, which can be before the
        read was handed over: the start is then the hand-over."""
        return max(r.handed_host_ns, self.clock.host_of(r.start_ns)), self.clock.host_of(r.done_ns)

    def take_host_lost(self) -> int:
        """The host compute lost to reads so far and not yet paid, in ns; now paid."""
        lost = int(self.host_lost_ns)
        self.host_lost_ns -= lost
        return lost

    def totals(self, until_ns: int) -> tuple[int, int, int, int]:
        """(bytes, reads, experts read, experts read into scratch) of the reads done by
        host time `until_ns` (libspice books a read once it is done)."""
        until = self.clock.disk_of(until_ns)
        nbytes = reads = experts = scratch = 0
        for r in self.log:
            if 0 <= r.done_ns <= until:
                nbytes += r.nbytes
                reads += r.n_reads
                experts += 1
                scratch += r.scratch
        return nbytes, reads, experts, scratch


@dataclass
class SimDiskTier(SimTier):
    """SimTier with the disk device's rules (module docstring): `bandwidth_gbps` and
    `latency_us` are the store's figures (its estimates); `rules` the disk's."""

    rules: DiskRules | None = None
    device: DiskDevice | None = None
    _reads: dict[tuple[int, int], Read] = field(default_factory=dict)
    scratch_ns: int = 0  # time calls waited for their host actions' reads
    contention_ns: int = 0  # host compute lost to reads done while it computed (paid so far)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rules is None:
            raise ValueError("a disk tier needs its rules (DiskRules)")
        scale = self.rules.read_scale
        self.device = DiskDevice(
            self.bandwidth_gbps / scale,
            self.rules.read_latency_us * scale,
            self.rules.readers,
            overlap=self.rules.overlap,
            host_read_us=self.rules.host_read_us,
        )

    @property
    def disk(self) -> DiskDevice:
        assert self.device is not None
        return self.device

    def _can_start(self, now: int) -> bool:
        self.disk.advance(now)
        started = sum(1 for c in self.copies.values() if c.started)
        return started < 2 * self.disk.readers

    def _issue(self, c: Copy, now: int) -> None:
        occupancy = int(c.nbytes / self.bandwidth_gbps)
        c.start_ns = max(self.bus_free_ns, now)
        c.end_ns = c.start_ns + int(self.latency_us * 1e3) + occupancy
        self.bus_free_ns = c.start_ns + occupancy
        assert self.rules is not None
        n_reads, nbytes = self.rules.reads.of(c.layer, c.expert)
        self._reads[(c.layer, c.expert)] = self.disk.submit(nbytes, n_reads, c.priority, now)

    def _landed_by(self, c: Copy, now: int) -> bool:
        self.disk.advance(now)
        done = self._reads[(c.layer, c.expert)].done_ns
        return 0 <= done <= self.disk.clock.disk_of(now)

    def _done_ns(self, c: Copy) -> int:
        return self.disk.finish(self._reads[(c.layer, c.expert)], self.now_ns)

    def _copy_ns(self, c: Copy) -> int:
        start, done = self.disk.host_ns(self._reads.pop((c.layer, c.expert)))
        return done - start

    def read_for_host(self, layer: int, experts: Sequence[int]) -> int:
        """spice_runtime_read_host_experts: read `experts` of `layer` into scratch, ahead of
        every queued read, and wait for them all; returns the time the call spent (the
        clock moves on): first the host compute that reads done while it computed took
        (DiskRules.host_read_us, booked in contention_ns), then the wait for the reads."""
        assert self.rules is not None
        now = self.now_ns
        self.disk.advance(now)
        lost = self.disk.take_host_lost()
        if lost:
            now += lost
            self.disk.advance(now)  # computing what it lost: the disk moves as it does meanwhile
            self.contention_ns += lost
        reads = []
        for e in experts:
            n_reads, nbytes = self.rules.reads.of(layer, e)
            reads.append(self.disk.submit(nbytes, n_reads, PRIORITY_HOST_READ, now, scratch=True))
        done = max((self.disk.finish(r) for r in reads), default=now)
        wait = max(0, done - now)
        self.now_ns = max(now, done)
        self.scratch_ns += wait
        return lost + wait

    def reset_counters(self) -> None:
        """As spice_runtime_preload leaves them: the reads done so far are booked nowhere."""
        super().reset_counters()
        now = self.disk.clock.disk_of(self.now_ns)
        self.disk.log = [r for r in self.disk.log if r.done_ns < 0 or r.done_ns > now]
        self.scratch_ns = 0
        self.contention_ns = 0

    def read_totals(self, until_ns: int) -> tuple[int, int, int, int]:
        """(bytes, reads, experts, scratch experts) of the reads done by `until_ns`."""
        return self.disk.totals(until_ns)
