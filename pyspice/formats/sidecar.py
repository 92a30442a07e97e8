"""The sidecar GGUF (`<model>.spice.gguf`, docs/design.md section 5).

Written and read with the `gguf` package. Keys (`spice.*`): format version,
the target model's name and fingerprint, calibration corpus and token count,
MoE layers, geometry, gating, draft and LoRE ranks. Tensors, per MoE layer l:

    spice.draft.{l}.u      [n_embd, r_draft]  f16   transition to the next MoE layer's input,
    spice.draft.{l}.v      [r_draft, n_embd]  f16   h' ≈ scale·h + bias + U V h
    spice.draft.{l}.bias   [n_embd]           f32   (all absent for the last MoE layer)
    spice.draft.{l}.scale  [1]                f32
    spice.lore.{l}.a       [n_expert, R, n_embd] f16   LoRE A per expert, zero-padded to R rows
    spice.lore.{l}.b       [n_expert, n_embd, R] f16   LoRE B per expert
    spice.lore.{l}.alpha   [n_expert]         f32   (0 without a shared expert)
    spice.lore.{l}.rank    [n_expert]         i32   rank used (0: no surrogate for this expert)
    spice.lore.{l}.error   [n_expert]         f32   held-out relative error of the surrogate
    spice.lore.{l}.error_shared / error_drop  f32   same for "shared expert alone" and "drop"
    spice.lore.{l}.count   [n_expert]         i32   calibration tokens routed to each expert

Optional keys, absent from older sidecars (which load as before): the lossy
quality levels' surrogate thresholds tuned for this model on its calibration
split (`pyspice calibrate --levels`), which `spice:balanced` and
`spice:fast` use in place of the shared constants:

    spice.levels.{balanced,fast}.max_weight  f64   gate weight below which a miss may be substituted
    spice.levels.{balanced,fast}.max_error   f64   surrogate error at most which it is trusted
    spice.levels.tuned_on                    str   how they were tuned (text, budgets, margin)

The fingerprint identifies the target model without reading it whole: a hash
of every tensor's name, shape and type plus 16 blocks of 64 KiB at fixed
offsets spread over the file (and its size), so it takes milliseconds even
for a 40 GB file.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFWriter

from pyspice.formats.gguf_checks import SIDECAR_ARCH
from pyspice.formats.gguf_header import parse_header
from pyspice.formats.model_info import ModelFileError, read_header
from pyspice.formats.routers import RouterReader
from pyspice.outputs import OutputPathError, atomic_output, check_output
from pyspice.policy.predictor import DraftPredictor, Transition
from pyspice.policy.spice.config import LEVEL_BOUNDS, SurrogateThresholds

SIDECAR_VERSION = 1
_SAMPLE_BLOCKS = 16
_SAMPLE_BYTES = 64 << 10

F32 = npt.NDArray[np.float32]


class SidecarError(ValueError):
    """A sidecar that reads as a GGUF but not as a sidecar this pyspice can use."""


class SidecarDataError(ValueError):
    """A sidecar whose header reads but whose contents cannot be used (non-finite weights)."""


class SidecarMismatchError(ValueError):
    """The sidecar was made for another model."""


def tensor_signature(model_path: str | os.PathLike[str]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape, type name) of every tensor of a GGUF, in file order (header only)."""
    header = read_header(Path(model_path))
    return [(t.name, tuple(int(x) for x in t.shape), t.type_name) for t in header.tensors]


def fingerprint(model_path: str | os.PathLike[str]) -> str:
    """A short identity of a GGUF: tensor names, shapes, types and sampled blocks of the file."""
    path = Path(model_path)
    h = hashlib.sha256()
    for name, shape, ttype in tensor_signature(path):
        h.update(f"{name}:{','.join(map(str, shape))}:{ttype};".encode())
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLE_BLOCKS):
            f.seek(size * i // _SAMPLE_BLOCKS)
            h.update(f.read(_SAMPLE_BYTES))
    return "sha256:" + h.hexdigest()[:32]


def default_sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    p = Path(model_path)
    stem = p.name[: -len(".gguf")] if p.name.endswith(".gguf") else p.name
    return p.with_name(stem + ".spice.gguf")


@dataclass
class LayerSurrogates:
    """LoRE surrogates of one MoE layer's experts."""

    A: F32  # [n_expert, R, n_embd]
    B: F32  # [n_expert, n_embd, R]
    alpha: F32  # [n_expert]
    rank: npt.NDArray[np.int32]  # [n_expert]
    error: F32  # [n_expert] held-out relative error
    error_shared: F32  # [n_expert] error of alpha=1 shared expert alone (nan without one)
    error_drop: F32  # [n_expert] error of dropping the expert (1 by definition where defined)
    count: npt.NDArray[np.int64] | None = None  # [n_expert] calibration tokens routed to each expert


@dataclass
class SidecarData:
    model: str
    fingerprint: str
    moe_layers: list[int]
    n_embd: int
    n_expert: int
    n_expert_used: int
    gating: str = "softmax"
    corpus: str = ""
    tokens: int = 0
    draft_rank: int = 0
    lore_rank: int = 0
    has_shared: bool = True
    transitions: dict[int, Transition] = field(default_factory=dict)
    surrogates: dict[int, LayerSurrogates] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)
    # the lossy levels' thresholds tuned for this model ("spice:balanced" -> ...); empty
    # in a sidecar that was never tuned (the levels then use the shared constants)
    levels: dict[str, SurrogateThresholds] = field(default_factory=dict)
    levels_tuned_on: str = ""  # how they were tuned, for the record
    # the file mapping the matrices are views of (read_sidecar's; None for data made in memory)
    mapping: Any = field(default=None, repr=False, compare=False)


def _level_key(level: str) -> str:
    """spice.levels.<key>.*: a level's name without the `spice:` prefix."""
    if level not in LEVEL_BOUNDS:
        raise ValueError(f"{level!r} is not a lossy quality level ({', '.join(LEVEL_BOUNDS)})")
    return level.removeprefix("spice:")


def _gguf_architecture(path: Path) -> str | None:
    """general.architecture of the GGUF at `path`; None when it is not a readable GGUF."""
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = parse_header(buf, path, max_array_items=0)
    except (OSError, ValueError):  # empty (mmap refuses), not a GGUF, or truncated
        return None
    arch = next((kv.value for kv in header.metadata if kv.key == "general.architecture"), None)
    return str(arch) if arch is not None else None


def check_sidecar_output(out: Path, model: Path) -> Path:
    """The rule for a sidecar's output path, checked before calibrating: never the
    model itself, a directory, or an existing file that is not a sidecar (another
    model, say); an older sidecar is replaced."""
    check_output(out, [model])
    if out.exists() and _gguf_architecture(out) != SIDECAR_ARCH:
        raise OutputPathError(
            f"-o {out} exists and is not a pyspice sidecar (a model?): refusing to replace it; "
            "pick another path or delete it first"
        )
    return out


def write_sidecar(path: str | os.PathLike[str], data: SidecarData) -> Path:
    """Write a sidecar GGUF atomically: a reader never sees half a file, and a
    failed write leaves nothing behind."""
    out = Path(path)
    with atomic_output(out) as tmp:
        _write_sidecar_to(tmp, data)
    return out


def _write_sidecar_to(tmp: Path, data: SidecarData) -> None:
    w = GGUFWriter(tmp, SIDECAR_ARCH)
    w.add_uint32("spice.version", SIDECAR_VERSION)
    w.add_string("spice.model", data.model)
    w.add_string("spice.fingerprint", data.fingerprint)
    w.add_string("spice.corpus", data.corpus)
    w.add_uint64("spice.tokens", int(data.tokens))
    w.add_array("spice.moe_layers", [int(x) for x in data.moe_layers])
    w.add_uint32("spice.n_embd", data.n_embd)
    w.add_uint32("spice.n_expert", data.n_expert)
    w.add_uint32("spice.n_expert_used", data.n_expert_used)
    w.add_string("spice.gating", data.gating)
    w.add_uint32("spice.draft_rank", data.draft_rank)
    w.add_uint32("spice.lore_rank", data.lore_rank)
    w.add_bool("spice.has_shared", data.has_shared)
    for k, v in data.extra.items():
        w.add_string(f"spice.extra.{k}", v)
    for level, limits in sorted(data.levels.items()):
        key = _level_key(level)
        w.add_float64(f"spice.levels.{key}.max_weight", float(limits.max_weight))
        w.add_float64(f"spice.levels.{key}.max_error", float(limits.max_error))
    if data.levels:
        w.add_string("spice.levels.tuned_on", data.levels_tuned_on)
    for il, t in sorted(data.transitions.items()):
        w.add_tensor(f"spice.draft.{il}.u", np.ascontiguousarray(t.U, dtype=np.float16))
        w.add_tensor(f"spice.draft.{il}.v", np.ascontiguousarray(t.V, dtype=np.float16))
        w.add_tensor(f"spice.draft.{il}.bias", np.ascontiguousarray(t.bias, dtype=np.float32))
        w.add_tensor(f"spice.draft.{il}.scale", np.array([t.scale], dtype=np.float32))
    for il, s in sorted(data.surrogates.items()):
        w.add_tensor(f"spice.lore.{il}.a", np.ascontiguousarray(s.A, dtype=np.float16))
        w.add_tensor(f"spice.lore.{il}.b", np.ascontiguousarray(s.B, dtype=np.float16))
        w.add_tensor(f"spice.lore.{il}.alpha", np.ascontiguousarray(s.alpha, dtype=np.float32))
        w.add_tensor(f"spice.lore.{il}.rank", np.ascontiguousarray(s.rank, dtype=np.int32))
        w.add_tensor(f"spice.lore.{il}.error", np.ascontiguousarray(s.error, dtype=np.float32))
        w.add_tensor(f"spice.lore.{il}.error_shared", np.ascontiguousarray(s.error_shared, dtype=np.float32))
        w.add_tensor(f"spice.lore.{il}.error_drop", np.ascontiguousarray(s.error_drop, dtype=np.float32))
        if s.count is not None:
            w.add_tensor(f"spice.lore.{il}.count", np.ascontiguousarray(s.count, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_sidecar(path: str | os.PathLike[str], *, tensors: bool = True) -> SidecarData:
    """The sidecar at `path`; with tensors=False its keys only (what it was calibrated
    on, the levels it carries: a tenth of the time), without transitions or surrogates."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sidecar {p} does not exist (make one with `pyspice calibrate`)")
    try:
        read_header(p)  # bounds-checked: a truncated or foreign file is one clear line
    except ModelFileError as exc:
        raise ModelFileError(f"bad sidecar: {exc}; remake it with `pyspice calibrate -m MODEL`") from None
    try:
        reader = GGUFReader(p)
    except Exception as exc:  # the gguf package's parser has no error type of its own
        raise ValueError(
            f"bad sidecar: {p} cannot be read ({type(exc).__name__}: {exc}); {_REMAKE}"
        ) from None
    _read_at_random(reader.data)
    try:
        return _sidecar_data(reader, p, tensors)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, SidecarError):
            raise
        raise ValueError(f"bad sidecar: {p} is corrupt ({type(exc).__name__}: {exc}); {_REMAKE}") from None


_REMAKE = "remake it with `pyspice calibrate -m MODEL`"


def _read_at_random(mapping: Any) -> None:
    """No read-ahead on the sidecar's mapping (MADV_RANDOM). Loading touches a few small
    tensors between the large ones, and the kernel's read-ahead around each of those
    faults read the whole file into the page cache: 25 MiB on smolmoe-b where a lossless
    policy reads none of it, charged to the process's memory cgroup, which is what edge
    mode's memory limit is taken from. A policy that reads a matrix still gets it in
    one sequential pass over its pages."""
    mm = _mmap_of(mapping)
    if mm is not None and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)


def _mmap_of(mapping: Any) -> mmap.mmap | None:
    """The mmap.mmap under a numpy.memmap (which keeps it as `_mmap`), if any."""
    mm = getattr(mapping, "_mmap", None)
    return mm if isinstance(mm, mmap.mmap) else None


def _sidecar_data(reader: Any, p: Path, with_tensors: bool = True) -> SidecarData:
    if _field(reader, "general.architecture") != SIDECAR_ARCH:
        raise SidecarError(f"{p} is not a pyspice sidecar (no {SIDECAR_ARCH} architecture key)")
    version = int(_field(reader, "spice.version", 0))
    if version > SIDECAR_VERSION:
        raise SidecarError(f"sidecar {p} has format version {version}; this pyspice reads {SIDECAR_VERSION}")
    tensors = {t.name: t for t in reader.tensors}

    def stored(name: str) -> Any:
        """The tensor as the file holds it: a read-only view of the reader's mapping."""
        t = tensors.get(name)
        if t is None:
            raise SidecarError(f"bad sidecar: {p} has no tensor {name}; {_REMAKE}")
        return np.asarray(t.data).reshape(tuple(int(x) for x in reversed(t.shape)))

    def arr(name: str, dtype: type = np.float32) -> Any:
        return np.array(stored(name), dtype=dtype)  # a copy of its own

    data = SidecarData(
        model=str(_field(reader, "spice.model", "")),
        fingerprint=str(_field(reader, "spice.fingerprint", "")),
        moe_layers=[int(x) for x in _field(reader, "spice.moe_layers", [])],
        n_embd=int(_field(reader, "spice.n_embd", 0)),
        n_expert=int(_field(reader, "spice.n_expert", 0)),
        n_expert_used=int(_field(reader, "spice.n_expert_used", 0)),
        gating=str(_field(reader, "spice.gating", "softmax")),
        corpus=str(_field(reader, "spice.corpus", "")),
        tokens=int(_field(reader, "spice.tokens", 0)),
        draft_rank=int(_field(reader, "spice.draft_rank", 0)),
        lore_rank=int(_field(reader, "spice.lore_rank", 0)),
        has_shared=bool(_field(reader, "spice.has_shared", True)),
        extra={
            k[len("spice.extra.") :]: str(_field(reader, k))
            for k in reader.fields
            if k.startswith("spice.extra.")
        },
        levels=_levels(reader),
        levels_tuned_on=str(_field(reader, "spice.levels.tuned_on", "")),
        mapping=reader.data,
    )
    # The weight matrices stay views of the mapping in their stored type (f16), not float32
    # copies: their pages are the page cache's, read in when used and reclaimable under
    # memory pressure, so what a policy never reads costs it no memory (a lossless policy
    # reads no surrogate, a rule no transition: 50 MiB of float32 on smolmoe-b, which
    # tipped edge mode's rows under a memory limit into thrashing). Sidecar.surrogate and
    # DraftPredictor convert what they use.
    for il in data.moe_layers if with_tensors else []:
        if f"spice.draft.{il}.u" in tensors:
            data.transitions[il] = Transition(
                stored(f"spice.draft.{il}.u"),
                stored(f"spice.draft.{il}.v"),
                arr(f"spice.draft.{il}.bias"),
                float(arr(f"spice.draft.{il}.scale")[0]),
            )
        if f"spice.lore.{il}.a" in tensors:
            data.surrogates[il] = LayerSurrogates(
                A=stored(f"spice.lore.{il}.a"),
                B=stored(f"spice.lore.{il}.b"),
                alpha=arr(f"spice.lore.{il}.alpha"),
                rank=arr(f"spice.lore.{il}.rank", np.int32),
                error=arr(f"spice.lore.{il}.error"),
                error_shared=arr(f"spice.lore.{il}.error_shared"),
                error_drop=arr(f"spice.lore.{il}.error_drop"),
                count=(
                    arr(f"spice.lore.{il}.count", np.int64) if f"spice.lore.{il}.count" in tensors else None
                ),
            )
    return data


def _levels(reader: Any) -> dict[str, SurrogateThresholds]:
    """The tuned thresholds a sidecar carries (none in one written before they existed);
    a level with only one of its two keys is corrupt."""
    levels: dict[str, SurrogateThresholds] = {}
    for level in LEVEL_BOUNDS:
        key = _level_key(level)
        weight = _field(reader, f"spice.levels.{key}.max_weight")
        error = _field(reader, f"spice.levels.{key}.max_error")
        if weight is None and error is None:
            continue
        if weight is None or error is None:
            raise ValueError(f"{level} has only one of spice.levels.{key}.max_weight / max_error")
        levels[level] = SurrogateThresholds(float(weight), float(error))
    return levels


def with_levels(path: str | os.PathLike[str], levels: dict[str, SurrogateThresholds], tuned_on: str) -> Path:
    """Rewrite the sidecar at `path` with these tuned thresholds (replacing any it had),
    everything else as it was; atomically, as write_sidecar."""
    data = read_sidecar(path)
    data.levels = dict(levels)
    data.levels_tuned_on = tuned_on
    return write_sidecar(path, data)


def check_shapes(data: SidecarData, path: Path) -> None:
    """Each layer's surrogate tensors agree: A [E, R, n_embd], B [E, n_embd, R], and
    alpha, rank, errors [E] with ranks in 0..R (Sidecar.surrogate slices by rank)."""
    for il, t in sorted(data.transitions.items()):
        d = t.bias.shape[0] if t.bias.ndim == 1 else -1
        r = t.U.shape[1] if t.U.ndim == 2 else -1
        if d < 0 or r < 0 or t.U.shape != (d, r) or t.V.shape != (r, d) or (data.n_embd and d != data.n_embd):
            raise SidecarError(
                f"bad sidecar: {path}: layer {il}'s draft transition tensors disagree in shape "
                f"(u {list(t.U.shape)}, v {list(t.V.shape)}, bias {list(t.bias.shape)}); {_REMAKE}"
            )
    for il, s in sorted(data.surrogates.items()):
        if s.A.ndim != 3 or s.B.ndim != 3:
            raise SidecarError(f"bad sidecar: {path}: spice.lore.{il}.a/b are not 3-dimensional; {_REMAKE}")
        n_exp, rank, n_embd = s.A.shape
        vectors = (s.alpha, s.rank, s.error, s.error_shared, s.error_drop)
        if (
            s.B.shape != (n_exp, n_embd, rank)
            or (data.n_embd and n_embd != data.n_embd)
            or any(v.shape != (n_exp,) for v in vectors)
            or (s.count is not None and s.count.shape != (n_exp,))
            or (s.rank.size and (int(s.rank.min()) < 0 or int(s.rank.max()) > rank))
        ):
            raise SidecarError(
                f"bad sidecar: {path}: layer {il}'s surrogate tensors disagree in shape "
                f"(a {list(s.A.shape)}, b {list(s.B.shape)}, n_embd {data.n_embd}); {_REMAKE}"
            )


def _refuse_non_finite(path: Path, name: str, values: npt.NDArray[Any]) -> None:
    bad = int(np.count_nonzero(~np.isfinite(values)))
    if bad:
        raise SidecarDataError(
            f"sidecar {path} is corrupt: tensor {name} holds {bad} NaN or infinite values; "
            "remake it with `pyspice calibrate -m MODEL`"
        )


def check_finite_vectors(data: SidecarData, path: Path) -> None:
    """Refuse NaN or infinite weights among the small tensors, which loading copies:
    a surrogate's NaN alpha turns every activation it replaces into NaN logits
    (greedy decoding then emits token 0 forever), a NaN bias poisons every
    prediction, silently. The error tables may hold NaN by design ("no held-out
    tokens"), so only the weights are checked. The matrices are checked where they
    are first read (Sidecar.check_weights)."""
    for il, t in sorted(data.transitions.items()):
        _refuse_non_finite(path, f"spice.draft.{il}.bias", t.bias)
        _refuse_non_finite(path, f"spice.draft.{il}.scale", np.array([t.scale]))
    for il, s in sorted(data.surrogates.items()):
        _refuse_non_finite(path, f"spice.lore.{il}.alpha", s.alpha)


class TruncatedSurrogates:
    """A sidecar's surrogates cut to rank <= `rank` (the first columns of B, rows of A).

    B's columns are the fit's nested singular basis, and A's rows for a
    smaller basis are the same ridge solution's first rows, so this is the
    rank-r fit with the stored rank's α (refitting α per rank is the only
    difference from calibrating at that rank)."""

    def __init__(self, sidecar: Sidecar, rank: int) -> None:
        self.sidecar = sidecar
        self.rank = int(rank)

    def surrogate(self, layer: int, expert: int) -> tuple[float, F32, F32] | None:
        entry = self.sidecar.surrogate(layer, expert)
        if entry is None:
            return None
        alpha, A, B = entry
        return alpha, np.ascontiguousarray(A[: self.rank]), np.ascontiguousarray(B[:, : self.rank])


class Sidecar:
    """A loaded sidecar, checked against its target model.

    `Sidecar.load(path, model_path)` refuses a sidecar made for another model;
    model_path=None skips the check (and `predictor()` then needs routers).

    Loading reads no weight matrix: the draft transitions and the surrogates stay
    in the file's mapping until a policy reads them, and each part is checked for
    NaN or infinite values then, once (`check_weights`; the predictor and the
    surrogates check their own part). A policy that reads none of them -- every
    baseline, `spice:exact`'s surrogates -- costs no memory for them: on smolmoe-b
    the finiteness check alone paged in the whole 26 MiB file, which raised the
    floor that edge mode's memory limit is taken from.
    """

    def __init__(self, data: SidecarData, path: Path, model_path: Path | None) -> None:
        self.data = data
        self.path = path
        self.model_path = model_path
        self._checked: set[str] = set()  # the parts check_weights has read: "draft", "lore.<il>"

    @classmethod
    def load(cls, path: str | os.PathLike[str], model_path: str | os.PathLike[str] | None) -> Sidecar:
        data = read_sidecar(path)
        check_shapes(data, Path(path))
        check_finite_vectors(data, Path(path))
        mp = Path(model_path) if model_path is not None else None
        if mp is not None:
            fp = fingerprint(mp)
            if fp != data.fingerprint:
                raise SidecarMismatchError(
                    f"sidecar {Path(path).name} was made for model {data.model} ({data.fingerprint}), "
                    f"not for {mp.name} ({fp}); run `pyspice calibrate -m {mp}` to make one for it"
                )
        loaded = cls(data, Path(path), mp)
        loaded.release_pages()  # parsing the header and copying the small tensors touched them
        return loaded

    def release_pages(self) -> None:
        """Drop the sidecar's pages from this process's resident set (MADV_DONTNEED over
        its read-only mapping) and from the page cache (POSIX_FADV_DONTNEED: pages no
        other process maps) once what needed them is done: the header parsed at load,
        the transitions the predictor composed, the surrogates copied into the runtime.
        They stop counting against its RSS (6-10 MiB of a SPICE row's on smolmoe-b) and
        against its memory cgroup, which edge mode's memory limit is taken from and
        judged by (the clean pages would be reclaimed under pressure, but reclaim takes
        the model's pages too, and a cgroup's peak counts them); a later read faults
        them back in from the file."""
        mm = self._mmap()
        if mm is not None:
            mm.madvise(mmap.MADV_DONTNEED)
            self._drop_cached([(0, len(mm))])

    def release_views(self, *views: npt.NDArray[Any]) -> None:
        """release_pages for the pages under these views of the mapping only (whole pages:
        a neighbour's share of a boundary page faults back in when read)."""
        mm = self._mmap()
        if mm is None:
            return
        base = int(self.data.mapping.ctypes.data)
        ranges: list[tuple[int, int]] = []
        for view in views:
            start = int(view.ctypes.data) - base
            if start < 0 or start + view.nbytes > len(mm):
                continue  # not a view of this mapping (a copy)
            first = start - start % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, first, start + view.nbytes - first)
            ranges.append((first, start + view.nbytes - first))
        self._drop_cached(ranges)

    def _drop_cached(self, ranges: list[tuple[int, int]]) -> None:
        """POSIX_FADV_DONTNEED over each (offset, length) of the file (the mapping starts
        at its first byte). Advice only: where it cannot be given, nothing is lost."""
        if not ranges or not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # replaced or removed since load: the pages are no longer this file's
        try:
            for offset, length in ranges:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _mmap(self) -> mmap.mmap | None:
        return _mmap_of(self.data.mapping) if hasattr(mmap, "MADV_DONTNEED") else None

    # ---- metadata ---------------------------------------------------------------

    @property
    def moe_layers(self) -> list[int]:
        return list(self.data.moe_layers)

    @property
    def corpus(self) -> str:
        return self.data.corpus

    @property
    def tokens(self) -> int:
        return self.data.tokens

    @property
    def levels(self) -> dict[str, SurrogateThresholds]:
        """The lossy levels' thresholds tuned for this model (empty: never tuned)."""
        return dict(self.data.levels)

    # ---- weights, checked when first read ------------------------------------------

    def check_weights(self, *, draft: bool = True, surrogates: bool = True) -> None:
        """Refuse NaN or infinite values in the draft transitions and/or every layer's
        surrogates now (SidecarDataError naming the tensor), rather than when a policy
        first reads them: a run that will read them fails before its model loads."""
        if draft:
            self._check_draft()
        for il in self.data.surrogates if surrogates else []:
            self._check_lore(il)

    def _check_draft(self) -> None:
        if "draft" in self._checked:
            return
        for il, t in sorted(self.data.transitions.items()):
            _refuse_non_finite(self.path, f"spice.draft.{il}.u", t.U)
            _refuse_non_finite(self.path, f"spice.draft.{il}.v", t.V)
        self._checked.add("draft")

    def _check_lore(self, layer: int) -> None:
        key = f"lore.{layer}"
        s = self.data.surrogates.get(layer)
        if key in self._checked or s is None:
            return
        _refuse_non_finite(self.path, f"spice.lore.{layer}.a", s.A)
        _refuse_non_finite(self.path, f"spice.lore.{layer}.b", s.B)
        self._checked.add(key)

    # ---- draft predictor ---------------------------------------------------------

    def predictor(self, routers: Any = None) -> DraftPredictor:
        """The draft predictor; routers come from the target model unless given
        (a mapping or a callable layer -> [n_expert, n_embd])."""
        if routers is None:
            if self.model_path is None:
                raise ValueError("the sidecar was loaded without its model: pass routers= to predictor()")

            routers = RouterReader(self.model_path)
        self._check_draft()
        get = routers if callable(routers) else routers.__getitem__
        table = {}
        for il in self.data.moe_layers:
            w = get(il)
            if w is None:
                raise ValueError(f"the target model has no router for MoE layer {il}")
            table[il] = w
        predictor = DraftPredictor(
            self.data.moe_layers,
            table,
            self.data.transitions,
            self.data.gating,
            release=lambda t: self.release_views(t.U, t.V),  # a layer's pages once composed
        )
        self.release_pages()  # the composed maps are the predictor's own
        return predictor

    # ---- surrogates ----------------------------------------------------------------

    def expert_counts(self, layer: int) -> npt.NDArray[np.int64] | None:
        """Calibration tokens routed to each expert of a layer (None if not recorded)."""
        s = self.data.surrogates.get(layer)
        return None if s is None or s.count is None else s.count

    def has_surrogate(self, layer: int, expert: int) -> bool:
        """Whether a surrogate was fitted for this expert (its rank and alpha only: no
        weight is read)."""
        s = self.data.surrogates.get(layer)
        if s is None or not 0 <= expert < s.rank.shape[0]:
            return False
        return int(s.rank[expert]) > 0 or float(s.alpha[expert]) != 0.0

    def surrogate(self, layer: int, expert: int) -> tuple[float, F32, F32] | None:
        """(alpha, A [r, n_embd], B [n_embd, r]) in float32, or None where none was fitted."""
        if not self.has_surrogate(layer, expert):
            return None
        self._check_lore(layer)
        s = self.data.surrogates[layer]
        r = int(s.rank[expert])
        A = np.ascontiguousarray(s.A[expert, :r], dtype=np.float32)
        B = np.ascontiguousarray(s.B[expert, :, :r], dtype=np.float32)
        return float(s.alpha[expert]), A, B

    @property
    def surrogate_error(self) -> dict[int, list[float]]:
        return {il: [float(x) for x in s.error] for il, s in self.data.surrogates.items()}

    def surrogate_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of every surrogate's A and B at their fitted ranks (f16 as stored), plus alpha."""
        total = 0
        for s in self.data.surrogates.values():
            total += int(s.rank.sum()) * 2 * self.data.n_embd * dtype_bytes + 4 * int(s.rank.shape[0])
        return total
