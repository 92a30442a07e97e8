"""What distinguishes one SPICE variant from another: plain settings.

The quality levels (`spice:exact`, `spice:balanced`, `spice:fast`) differ only
in which misses may be replaced by a LoRE surrogate; the ablations of the
paper's Fig. 9 (`abl-a` … `abl-d`) switch off one mechanism at a time. Every
variant is the same `SpicePolicy` with a different `SpiceConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

MissMode = Literal["cost", "host", "fetch"]
SlotPrecision = Literal["exact", "4bit", "5bit"]


@dataclass(frozen=True)
class SpiceConfig:
    name: str
    # --- prediction (paper Algorithm 1) ---
    deep: bool = True  # False: next MoE layer only (H = 1)
    tau: float = 0.6  # stop rolling out below this confidence once past H_min
    # prefetch only the most probable part of each predicted top-K: on smolmoe the
    # next-layer router's rank-1 guess is right 91% of the time, its rank-12 guess 49%,
    # so the last third of a top-12 costs bus bytes for few hits
    prefetch_share: float = 0.6
    h_max: int = 4  # never look further than this many MoE layers ahead
    # decode steps plan prefetches at every plan_every-th MoE layer only, looking far
    # enough ahead to cover the layers in between, and libspice answers the calls in
    # between with the default plan without calling Python (Plan.resume_layer). Inside
    # the graph (caches cold after ggml's kernels) a planning call costs ~100-150 us on
    # smolmoe however little it does -- the entry from C, reading the predictor's maps
    # (one 32 x 576 float32 block per predicted layer), the look-ahead, the plan -- so
    # planning less often is what keeps the policy within 30 us per hook call of
    # exact-py's (tools/policy-cost.py --plain: +28 us at 4 against +38 at 3 and +48
    # at 2, hit rate 0.62 against 0.64 and 0.66). Deep variants only, and only as far
    # apart as the device budget holds (plan_every + 1) layers' top-k twice over;
    # plan_every=1 plans (and rolls out) at every hook call, the letter of Algorithm 1
    plan_every: int = 4
    # the same when the policy plans on libspice's planner thread (asynchronous, free-running
    # or deterministic) on a device tier: there a plan costs the hook's thread ~0.7 us, not
    # a Python call, so every layer plans. In the simulator on target-sized experts
    # (Qwen2-57B Q5_K_M, DeepSeek-V2-Lite Q4_K_M; h200 and rtx4060 profiles; 25% and 50%)
    # free-running, every layer against every fourth decoded faster in 22 of 24 level x
    # cell combinations (1-15%), level in one, +0.9% in one (spice:fast, DeepSeek-V2-Lite
    # h200 50%); deterministic (det1) faster in 20 of 24, slower in DeepSeek-V2-Lite h200
    # cells, where a layer is shorter than a plan and the hook's thread waits for each
    # (+0.6..+9%; docs/results/planning.md). Not in edge mode
    # (a tier that retains by use): there plan_every still applies; its plans issued no
    # prefetch in the simulator at either cadence (the rule fetches and keeps), so
    # planning more often would only add posts
    plan_every_async: int = 1
    # planning asynchronously, a plan lands a call or more after the call it was made at,
    # too late for the next layer: at each planning layer the engine's rule then prefetches
    # that layer's experts itself, by the next router on this call's input (from the graph),
    # taking room from the layers that run again last, as the planner's own plans do
    rule_next: bool = True
    # the token's last planning layer whose plan still lands within the token (the last
    # one, planning synchronously) also prefetches the next token's first MoE layer, which
    # no look-ahead reaches: this many x top-k of the experts it picked most lately
    # (lookahead.FirstLayerPrior; 0: off)
    first_layer_share: float = 2.0
    # --- misses ---
    miss_mode: MissMode = "cost"  # cost: fetch-or-host by the cost model; host: all host; fetch: all fetched
    fetch_margin: float = 0.2  # fetch only when it beats all-host by this fraction (paper section 4.3)
    # where a host action reads its expert first (edge mode: the disk tier), `cost`
    # fetches every miss into the pool instead of reading it into scratch and dropping
    # it (fetching costs no more there), and room comes from the resident experts with
    # the lowest use count decayed by this at each call of their layer: a frequency that
    # forgets, which read 1.7-1.9x MIN's bytes in the simulator where recency read 2.1-2.7x
    # (docs/results/edge-mode.md; 0.99 was the best of 0.9/0.97/0.99/0.995 on
    # calibration text)
    retention_decay: float = 0.99
    # --- surrogates (lossy; 0 disables) ---
    surrogate_max_weight: float = 0.0  # a miss whose gate weight is below this may be substituted
    surrogate_max_error: float = 0.0  # ... if its surrogate's held-out relative error is below this
    prefetch: bool = True  # False: no speculative copies at all
    # --- slots (lossy unless "exact") ---
    # "4bit": the device tier's slots hold every expert re-quantized to about 4.5 bits
    # (libspice's SPICE_SLOT_4BIT: IQ4_NL for a Q8_0 model), so the same budget holds
    # ~1.9x the experts and each copy moves ~0.53x the bytes; the host still runs its
    # misses on the model's own weights. "5bit": about 5.5 bits (SPICE_SLOT_5BIT: Q5_0
    # for a Q8_0 model), ~1.55x the experts. On smolmoe-b, every routed expert at IQ4_NL
    # moved perplexity by -0.62..+1.49% over three texts, at Q5_0 by -0.30..+0.33%
    # (docs/results/quality-levels.md): so spice:balanced (+1% bound) holds
    # 5-bit slots and spice:fast (+5%) 4-bit ones
    slot_precision: SlotPrecision = "exact"
    # --- start ---
    # True: a device tier starts filled in layer order as far as the budget goes, as
    # `exact` starts, not empty (never edge mode's disk tier, which fills itself:
    # SpicePolicy.preloads_tier). Off by default. On the emulated device a miss is never
    # fetched, so an empty start leaves room free and a prompt's first layers on the
    # host: there it cut spice:exact's host activations in bench (smolmoe-b, 128-token
    # prompt, 32 decoded, -t 1) by 27% at 25% and 44% at 50%, with decode hits unchanged.
    # But where misses are fetched (a real GPU) the prompt fills the pool with the experts
    # it uses, and a full start blocks that: in the simulator on Qwen2-57B's sizes
    # (h200, rtx4060; 25%, 50%) decode TPOT rose 0.5-9.2% for every level and decode hits
    # fell by up to 0.045, and a fill spread evenly over the layers in calibration-count
    # order still cost up to 5% at 50% (docs/results/cpu-overhead.md)
    preload: bool = False

    @property
    def substitutes(self) -> bool:
        """Whether some misses may be replaced by a surrogate."""
        return self.surrogate_max_weight > 0.0 and self.surrogate_max_error > 0.0

    @property
    def lossless(self) -> bool:
        return not self.substitutes and self.slot_precision == "exact"

    def with_name(self, name: str) -> SpiceConfig:
        return replace(self, name=name)


@dataclass(frozen=True)
class SurrogateThresholds:
    """A lossy level's two surrogate thresholds, tuned for one model (its sidecar
    carries them: pyspice.formats.sidecar, written by `pyspice calibrate --levels`)."""

    max_weight: float  # a miss whose gate weight is below this may be substituted ...
    max_error: float  # ... if its surrogate's held-out relative error is at most this

    def __post_init__(self) -> None:
        for what, value in (("max_weight", self.max_weight), ("max_error", self.max_error)):
            if not (value >= 0.0 and value < float("inf")):
                raise ValueError(f"surrogate threshold {what} must be finite and >= 0, got {value!r}")


# The lossy levels and the perplexity bound each keeps over spice:exact (token by token).
LEVEL_BOUNDS: dict[str, float] = {"spice:balanced": 0.01, "spice:fast": 0.05}

# Quality levels. A lossy level's surrogate thresholds belong with the surrogates
# they trust, so each model's come from its sidecar (`spice.levels.*`, see
# level_config): `pyspice calibrate --levels` chooses them on the CALIBRATION
# split of that model's corpus at 25% and 50% budgets, within 0.6 of the
# level's bound on calibration text, and writes them there; they are judged on
# text of no calibration source (docs/results/quality-levels.md).
# The constants below are the fallback for a sidecar without tuned thresholds
# (said once per level): smolmoe's first tuning, before per-model thresholds.
QUALITY_LEVELS: dict[str, SpiceConfig] = {
    "spice:exact": SpiceConfig("spice:exact"),
    "spice:balanced": SpiceConfig(
        "spice:balanced", surrogate_max_weight=0.05, surrogate_max_error=0.55, slot_precision="5bit"
    ),
    "spice:fast": SpiceConfig(
        "spice:fast", surrogate_max_weight=0.065, surrogate_max_error=0.7, slot_precision="4bit"
    ),
}
DEFAULT_LEVEL = "spice:exact"

# The paper's Fig. 9 ablations: prediction depth x what happens to a miss.
ABLATIONS: dict[str, SpiceConfig] = {
    "abl-a": SpiceConfig("abl-a", deep=True, miss_mode="fetch"),
    "abl-b": SpiceConfig("abl-b", deep=True, miss_mode="host"),
    "abl-c": SpiceConfig("abl-c", deep=False, miss_mode="host"),
    "abl-d": SpiceConfig("abl-d", deep=False, miss_mode="cost"),
}

ABLATION_DESCRIPTIONS = {
    "abl-a": "SPICE ablation (a): deep prediction + fetch every miss",
    "abl-b": "SPICE ablation (b): deep prediction + host fallback for every miss",
    "abl-c": "SPICE ablation (c): next-layer prediction + host fallback",
    "abl-d": "SPICE ablation (d): next-layer prediction + cost-aware transfer scheduling",
}


def spice_config(name: str) -> SpiceConfig:
    """A shipped variant by name, with the shared surrogate thresholds (see level_config
    for a model's own)."""
    if name == "spice":
        return QUALITY_LEVELS[DEFAULT_LEVEL].with_name("spice")
    if name in QUALITY_LEVELS:
        return QUALITY_LEVELS[name]
    if name in ABLATIONS:
        return ABLATIONS[name]
    raise ValueError(f"unknown SPICE variant {name!r}")


def level_config(
    name: str,
    tuned: Mapping[str, SurrogateThresholds] | None,
    note: Callable[[str], None] | None = None,
) -> SpiceConfig:
    """The variant `name` with the model's own surrogate thresholds where it is a lossy
    level and `tuned` (its sidecar's) has them; else the shared constants, with one
    `note` saying so for a lossy level (None: a model without a sidecar, which has no
    surrogates to substitute in the first place)."""
    config = spice_config(name)
    if name not in LEVEL_BOUNDS or tuned is None:
        return config
    own = tuned.get(name)
    if own is None:
        if note is not None:
            note(
                f"{name}: the sidecar has no surrogate thresholds tuned for this model; using the "
                f"shared ones (gate weight < {config.surrogate_max_weight:g}, error <= "
                f"{config.surrogate_max_error:g}; `pyspice calibrate --levels` tunes them)"
            )
        return config
    tuned_config = replace(config, surrogate_max_weight=own.max_weight, surrogate_max_error=own.max_error)
    if not tuned_config.substitutes:
        # the tuning writes (0, 0) for a level none of its cells (all measured with the
        # level's 4-bit slots) kept within the bound: the level runs lossless, slots too
        return replace(tuned_config, slot_precision="exact")
    return tuned_config
