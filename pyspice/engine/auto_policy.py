"""`--policy auto`: the fastest lossless policy for this machine, model and tier.

The simulator ranks the lossless candidates (AUTO_CANDIDATES: exact with its tier
preloaded, static, lru, adapmoe, spice with the predictor the run has) on the
run's own tier (its budget's bytes, its bus or disk) priced by this machine's
probe of the model, replaying a sample of the model's routing; the run takes the
fastest and says in one line what it chose and the runner-up's predicted ms/token.

What first use on a machine and model costs, both kept in the user cache:
- the probe (`pyspice probe`'s measurements, the same file it saves), with a
  progress bar; on a real GPU a probe of the emulated device is not enough and is
  redone with the GPU. The disk tier is not probed here (its host times would be
  the disk's): without a saved probe it is priced by profiles/disk.json, and says so.
- a routing sample: the model reading SAMPLE_PROMPT, then SAMPLE_REPLY for
  SAMPLE_TOKENS steps, one token at a time (teacher-forced; the prompt's rows warm the
  sim's tier as a run's prompt warms it) with the exact plan, routing and hidden
  rows recorded (routing-samples/ in the cache). A model routes a text it reads as it
  routes its own decode of that text; the reply is fixed prose rather than the model's
  greedy continuation because a small model's greedy decode falls into a loop of a
  few tokens, whose routing any cache holds (docs/results/auto-policy.md measured
  caches' hit rates 0.07 above the bench's on such a sample).
  A run that replays recorded routing (--replay-routing) ranks on that trace: the
  ids its hook will see.

Every figure here is simulated; the choice is a prediction, and the line says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pyspice.engine.decode_trace import finish_decode_trace, start_decode_trace
from pyspice.engine.device import DeviceTier
from pyspice.engine.probe import measure_profile
from pyspice.engine.profile import saved_profile
from pyspice.engine.replay import replay_workload
from pyspice.formats.profile import load_profile as load_cost_profile
from pyspice.formats.profile import model_fingerprint, profile_path, save_profile
from pyspice.formats.trace import TraceError, read_meta
from pyspice.paths import cache_dir
from pyspice.policy.profile import EMULATED, BatchCost, CostProfile
from pyspice.runtime import StoreParams
from pyspice.sim.costs import Costs
from pyspice.sim.hardware import (
    DISK,
    HardwareProfile,
    disk_costs,
    emulated_costs,
    load_profile,
    machine_profile,
    policy_profile,
    with_probe,
)
from pyspice.sim.rank import AUTO_CANDIDATES, Ranking, rank_lossless
from pyspice.sim.workload import Workload, from_trace

SAMPLE_TOKENS = 32
REPLAY_TOKENS = 256  # decode steps of a replayed trace ranked on (its whole, if shorter)
SAMPLE_PROMPT = (
    "Write a short guide for a new gardener: which vegetables grow well in a small plot, "
    "when to sow them, how much water they need, and how to keep pests away without chemicals."
)
# the reply the sample reads (teacher-forced): plain prose, longer than SAMPLE_TOKENS in
# any tokenizer, so the sample is never cut short by the text
SAMPLE_REPLY = (
    " A small plot rewards crops that give a lot for little room. Lettuce, radishes and "
    "spinach can be sown from early spring, every two weeks, so the harvest keeps coming; "
    "beans and courgettes go in once the soil is warm and the last frost has passed. "
    "Tomatoes want the sunniest corner and a stake. Water deeply twice a week rather than "
    "a little every day, early in the morning, at the roots and not on the leaves. Mulch "
    "keeps the soil moist and the weeds down. Against slugs, pick them off at dusk and "
    "set out shallow traps; marigolds and nasturtiums draw aphids away from the beans, "
    "and a net keeps birds off young seedlings."
)
SAMPLE_KIND = "teacher-forced"  # meta.extra['sample']: a sample recorded otherwise is recorded again

Note = Callable[[str], None]


@dataclass(frozen=True)
class AutoChoice:
    ranking: Ranking
    priced_by: str  # what the costs came from, in a few words
    sample: Path  # the routing trace ranked on

    @property
    def policy(self) -> str:
        return self.ranking.best.row

    def record(self) -> dict[str, Any]:
        """What a bench record keeps of the choice (every figure simulated)."""
        return {
            "chose": self.policy,
            "simulated_tpot_ms": {r.row: r.tpot_ms for r in self.ranking.rows},
            "left_out": dict(self.ranking.left_out),
            "priced_by": self.priced_by,
            "routing": str(self.sample),
        }

    def line(self) -> str:
        best = self.ranking.best
        text = f"auto: using '{best.row}' (simulated {best.tpot_ms:.2f} ms/token"
        runner = self.ranking.runner_up
        if runner is not None:
            text += f"; runner-up '{runner.row}' {runner.tpot_ms:.2f} ms/token"
        return text + f"; priced by {self.priced_by}; routing of {self.sample.name})"


def sample_dir(model: Path) -> Path:
    """Where the routing sample of this model file is kept."""
    return cache_dir() / "routing-samples" / f"{model.stem}-{model_fingerprint(model)}"


def _sample_ready(path: Path) -> bool:
    try:
        meta = read_meta(path)
    except (TraceError, OSError, ValueError):
        return False
    return meta.complete and meta.extra.get("sample") == SAMPLE_KIND


def record_sample(llm: Any, out: Path, progress: bool = True) -> Path:
    """The model's routing reading SAMPLE_REPLY after SAMPLE_PROMPT, SAMPLE_TOKENS one-token
    steps under the exact plan, into `out` (written beside and renamed, so an interrupted
    recording leaves nothing half-made). Each process records into a folder of its own, so
    two first uses at once do not mix their rows; the first to finish is kept."""
    _remove_abandoned(out)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    prompt = list(llm.tokenize(SAMPLE_PROMPT.encode("utf-8"), add_bos=True))
    reply = list(llm.tokenize(SAMPLE_REPLY.encode("utf-8"), add_bos=False))
    # a short context holds fewer
    n_decode = min(SAMPLE_TOKENS, len(reply), int(llm.n_ctx()) - len(prompt) - 1)
    if n_decode < 1:
        raise ValueError(f"a context of {llm.n_ctx()} tokens holds no routing sample: give -c 256 or more")
    reply = reply[:n_decode]
    recorder = start_decode_trace(llm, tmp, "exact")
    llm.reset()
    # the prompt one token at a time too: the recorder keeps one-token calls only (a
    # batch's last layer sees only the rows whose logits are wanted), and the sim's
    # prompt step warms the tier with these rows as a run's prompt warms it
    bar = tqdm(total=len(prompt) + n_decode, desc="auto: routing sample", unit="tok", disable=not progress)
    try:
        for token in prompt + reply:
            llm.eval([token])
            bar.update()
    finally:
        bar.close()
    finish_decode_trace(
        recorder, prompt_tokens=len(prompt), tokens=reply, prompt=SAMPLE_PROMPT, sample=SAMPLE_KIND
    )
    llm.reset()
    if _sample_ready(out):  # another process finished first: its sample stands
        shutil.rmtree(tmp)
        return out
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)  # not complete, or recorded otherwise: replaced
    try:
        tmp.rename(out)
    except OSError:
        if not _sample_ready(out):  # another process is replacing it at this moment
            raise
        shutil.rmtree(tmp)
    return out


def _remove_abandoned(out: Path) -> None:
    """Partial samples whose recording process has gone (interrupted or killed)."""
    for partial in out.parent.glob(f"{out.name}.partial*"):
        _, _, pid = partial.name.rpartition("-")
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def probe_for(llm: Any, model: Path, real_gpu: bool, note: Note, progress: bool = True) -> CostProfile:
    """The saved probe of this model, or one measured now (and saved, as `pyspice probe`
    saves it). On a real GPU a probe of the emulated device is measured again."""
    path = profile_path(model)
    if path.is_file():
        try:
            saved = load_cost_profile(path)
            if not plausible(saved):
                note(f"auto: the saved probe {path} shows no time for one token's experts; probing again")
            elif not real_gpu or not saved.device_emulated:
                return saved
            else:
                note("auto: the saved probe emulated its device; probing again with the GPU")
        except (ValueError, OSError, TypeError, KeyError):
            note(f"auto: the saved probe {path} is unreadable; probing again")
    steps = ["one token", "batch of 8", "batch of 32", "disk"] + (["real device"] if real_gpu else [])
    bar = tqdm(total=len(steps), desc="auto: probing this machine", unit="step", disable=not progress)
    try:
        measured = measure_profile(
            llm,
            model,
            bus_gbps=llm.spice_engine.device_params.bandwidth_gbps,
            bus_latency_us=llm.spice_engine.device_params.latency_us,
            progress=lambda _message: bar.update(),
            real_device=real_gpu,
        )
    finally:
        bar.close()
    if not plausible(measured):
        # kept, it would price every later choice: used for this run only
        note(
            "auto: warning: the probe measured no time for one token's experts (another process "
            "busy on these cores?); not saved: run `pyspice probe` on an idle machine"
        )
        return measured
    save_profile(measured, path)
    note(f"auto: probe saved to {path} (`pyspice probe` measures it again)")
    return measured


def plausible(probe: CostProfile) -> bool:
    """A probe whose timings can price a choice: its one-token decode step measured the
    experts' time above zero. Measured by difference (all experts minus none), it comes
    out at zero where other work on the cores swamps it; on an idle 2-core machine it
    was 7.2 us per activation for smolmoe-b (`pyspice probe -m smolmoe-b -t 2`)."""
    one = _one_token(probe)
    return one is not None and one.expert_us > 0


def _one_token(probe: CostProfile) -> BatchCost | None:
    """The probe's decode-step measurement (its smallest batch)."""
    return min(probe.batches, key=lambda b: b.tokens, default=None)


def tier_pricing(
    probe: CostProfile | None,
    tier: DeviceTier,
    params: StoreParams,
    workload: Workload,
    model: Path,
    expert_bytes: tuple[int, ...],
) -> tuple[HardwareProfile, Costs]:
    """The hardware profile and costs of the run's tier: the disk as probed (or
    profiles/disk.json), an emulated device with the run's own bus and the host's
    compute, or the GPU as probed."""
    if tier.disk:
        prof = load_profile(DISK)
        if probe is not None:
            prof = with_probe(prof, probe)
        return prof, disk_costs(prof, workload, model, expert_bytes)
    assert probe is not None
    if tier.emulated:
        one = _one_token(probe)
        assert one is not None  # a probe measures at least one batch
        probe = dataclasses.replace(
            probe,
            bus_gbps=params.bandwidth_gbps,
            bus_latency_us=params.latency_us,
            bus_source=f"{EMULATED} (this run's bus)",
            device_expert_us=one.expert_us,
            device_source=f"{EMULATED}: the host's own time",
        )
    prof = machine_profile(probe)
    return prof, emulated_costs(prof, workload, expert_bytes)


def choose(llm: Any, note: Note, *, progress: bool | None = None) -> AutoChoice | None:
    """Rank the candidates for `llm`'s tier and return the choice; None where the run
    has no tier to manage (exact is then the only lossless way to run)."""
    engine = llm.spice_engine
    tier = engine.device
    if tier is None:
        return None
    show = sys.stderr.isatty() if progress is None else progress
    model = Path(engine.model_path)
    real_gpu = not tier.emulated and not tier.disk
    probe: CostProfile | None
    if tier.disk:
        probe = saved_profile(model)
        if probe is None:
            note(
                "auto: no probe of this model on this machine: the disk tier is priced by "
                "profiles/disk.json (`pyspice probe -m MODEL` measures this machine's)"
            )
    else:
        probe = probe_for(llm, model, real_gpu, note, show)
    layers = llm.spice_layers()
    moe = [info.il for info in layers if info.is_moe]
    if engine.replay is not None:
        # the ids this run's hook will see: a recorded decode from its start, a text from its start
        replay = engine.replay
        sample = replay.source
        workload = replay_workload(
            replay, moe, layers[moe[0]].n_expert, decode_tokens=min(replay.n_tokens, REPLAY_TOKENS)
        )
    else:
        sample = sample_dir(model)
        if not _sample_ready(sample):
            record_sample(llm, sample, show)
        workload = from_trace(sample)
    expert_bytes = tuple(info.bytes_per_expert if info.is_moe else 0 for info in layers)
    prof, costs = tier_pricing(probe, tier, engine.device_params, workload, model, expert_bytes)
    context = engine.policy_context()  # the predictor and routers the run's policies get
    extra: dict[str, Any] = {}
    if context.predictor is not None:
        extra["predictor"] = context.predictor
    # a policy's attach notes (static's resident layers) are about simulated runs, not this one
    with contextlib.redirect_stderr(io.StringIO()):
        ranking = rank_lossless(
            workload,
            costs,
            tier.budget_bytes,
            AUTO_CANDIDATES,
            router=context.router if workload.n_embd > 0 else None,
            profile=policy_profile(prof, costs),
            context_extra=extra,
        )
    llm.spice_reset_stats()  # the probe and the sample are not the user's run
    return AutoChoice(ranking, _priced_by(tier, probe), sample)


def _priced_by(tier: DeviceTier, probe: CostProfile | None) -> str:
    """What the ranking's costs came from, in a few words."""
    if tier.disk:
        if probe is None:
            return "profiles/disk.json (no probe of this machine)"
        disk = "its disk as probed" if probe.disk_gbps is not None else "profiles/disk.json's disk"
        return f"this machine's probe ({disk})"
    if tier.emulated:
        return "this machine's probe with this run's emulated bus"
    return "this machine's probe of its GPU"
