"""What distinguishes one SPICE variant from another: plain settings.

The quality levels (`spice:exact`, `spice:balanced`, `spice:fast`) differ only
in which misses may be replaced by a LoRE surrogate; the ablations of the
paper's Fig. 9 (`abl-a` … `abl-d`) switch off one mechanism at a time. Every
variant is the same `SpicePolicy` with a different `SpiceConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

MissMode = Literal["cost", "host", "fetch"]


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
    # exact-py's (scripts/policy-cost.py --plain: +28 us at 4 against +38 at 3 and +48
    # at 2, hit rate 0.62 against 0.64 and 0.66). Deep variants only, and only as far
    # apart as the device budget holds (plan_every + 1) layers' top-k twice over;
    # plan_every=1 plans (and rolls out) at every hook call, the letter of Algorithm 1
    plan_every: int = 4
    # --- misses ---
    miss_mode: MissMode = "cost"  # cost: fetch-or-host by the cost model; host: all host; fetch: all fetched
    fetch_margin: float = 0.2  # fetch only when it beats all-host by this fraction (paper section 4.3)
    # --- surrogates (lossy; 0 disables) ---
    surrogate_max_weight: float = 0.0  # a miss whose gate weight is below this may be substituted
    surrogate_max_error: float = 0.0  # ... if its surrogate's held-out relative error is below this
    prefetch: bool = True  # False: no speculative copies at all

    @property
    def lossless(self) -> bool:
        return self.surrogate_max_weight <= 0.0 or self.surrogate_max_error <= 0.0

    def with_name(self, name: str) -> SpiceConfig:
        return replace(self, name=name)


# Quality levels. The surrogate thresholds bound how much a level may change
# the output: perplexity measured token by token within +1% (balanced) and +5%
# (fast) of exact. They are chosen on the CALIBRATION split of the default
# model's corpus (scripts/tune-quality-levels.py; smolmoe, sidecar rank 8 cut
# to fit 25% of the device budget), using at most 0.6 of each bound at 25% and
# 50% budgets, and judged on the held-out split (`pyspice eval ppl
# --token-by-token --policies spice:exact,spice:balanced,spice:fast`). On
# calibration text: error <= 0.55 costs +0.43% / +0.30% (25% / 50%), 0.6 already
# +1.08% at 25%; error <= 0.7 costs +0.48% / +1.91%, 0.8 over +20%. The gate
# weights of the misses that remain are all below 0.04 on smolmoe (flat top-12
# of 32), so the weight limits cap rather than select there.
QUALITY_LEVELS: dict[str, SpiceConfig] = {
    "spice:exact": SpiceConfig("spice:exact"),
    "spice:balanced": SpiceConfig("spice:balanced", surrogate_max_weight=0.05, surrogate_max_error=0.55),
    "spice:fast": SpiceConfig("spice:fast", surrogate_max_weight=0.065, surrogate_max_error=0.7),
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
    if name == "spice":
        return QUALITY_LEVELS[DEFAULT_LEVEL].with_name("spice")
    if name in QUALITY_LEVELS:
        return QUALITY_LEVELS[name]
    if name in ABLATIONS:
        return ABLATIONS[name]
    raise ValueError(f"unknown SPICE variant {name!r}")
