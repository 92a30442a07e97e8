"""Policy names accepted by `--policy` and `bench --policies`.

Four kinds of policy: `stock` (hook unregistered: the reference), `native`
(decided in libspice with no Python per layer), `rule` (a policy that declares a
per-activation rule once, which libspice then applies with no Python per layer:
the baselines) and `python` (a Policy object called from the hook); and `auto`,
the choice of one of the lossless ones for the run's machine and tier
(pyspice.engine.auto_policy), made once the tier exists. Only names that run are
listed, so `--help` never offers one that only says "not implemented".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Literal

from pyspice.policy.base import Policy, PolicyBase
from pyspice.policy.baselines import AdapMoE, HostOnly, LruCache, OnDemand, StaticLayers
from pyspice.policy.rule import RulePolicy
from pyspice.policy.spice import SpicePolicy
from pyspice.policy.spice.config import (
    ABLATION_DESCRIPTIONS,
    QUALITY_LEVELS,
    SurrogateThresholds,
    level_config,
)

# auto: not a policy of its own but the choice of one (pyspice.engine.auto_policy)
PolicyKind = Literal["stock", "native", "rule", "python", "auto"]
AUTO = "auto"
PolicyInput = Literal["ids", "hidden"]  # what a policy reads of each hook call beyond its ids
IDS: frozenset[PolicyInput] = frozenset({"ids"})
IDS_AND_HIDDEN: frozenset[PolicyInput] = frozenset({"ids", "hidden"})


@dataclass(frozen=True)
class PolicySpec:
    """Everything the engine, bench and the simulator need to know of a shipped policy
    before making it: nothing else tests a policy's name."""

    name: str
    kind: PolicyKind
    lossless: bool
    description: str
    needs_device: bool = False  # makes no sense without --device-budget
    factory: Callable[[], Policy | RulePolicy] | None = None  # python and rule policies
    reads_sidecar: bool = False  # the draft predictor, surrogates or error tables
    # what it reads of a call: a trace of routing alone (ids) runs only the "ids" ones
    inputs: frozenset[PolicyInput] = IDS
    asynchronous: bool = False  # can plan on the planner thread (`NAME@plan=async`)
    # on a trace of routing alone (no hidden rows): what it runs as instead ("": refused)
    without_hidden: str = ""

    def make(self) -> Policy | RulePolicy | None:
        """A fresh policy object; None for stock and native policies (nothing to make)."""
        return self.factory() if self.factory is not None else None


@dataclass(frozen=True)
class InputsVerdict:
    """Whether a policy runs on the inputs a run or a trace has (inputs_verdict)."""

    missing: str = ""  # why it cannot run at all ("" = it can)
    fallback: str = ""  # what it runs as instead of itself, where it still runs

    @property
    def runs_as_itself(self) -> bool:
        return not self.missing and not self.fallback


def inputs_verdict(spec: PolicySpec, *, hidden_rows: bool, routers: bool, predictor: bool) -> InputsVerdict:
    """What `spec` does where the routing has (or lacks) hidden rows, the model's routers
    are (or are not) at hand, and a predictor (a sidecar's draft or a routing-history
    one) is (or is not) given: the one rule `pyspice sim` (which refuses or notes) and
    `auto` (which leaves out anything that would not run as itself) both follow."""
    if "hidden" not in spec.inputs:
        return InputsVerdict()
    if spec.reads_sidecar:  # SPICE: the predictor is what reads the hidden rows
        if predictor:
            return InputsVerdict()
        return InputsVerdict(
            missing="no predictor: it predicts from hidden rows with a calibration sidecar's draft, or "
            "from expert ids with a routing-history predictor (`pyspice trace fit TRACE -o P.npz`, "
            "then --history-predictor P.npz)"
        )
    if hidden_rows and routers:
        return InputsVerdict()
    if spec.without_hidden:
        return InputsVerdict(fallback=spec.without_hidden)
    return InputsVerdict(missing="it reads hidden rows and the model's routers, which this routing lacks")


class ExactPassThrough(PolicyBase):
    """`exact-py`: every activation exact, decided in Python (measures the Python path's cost)."""

    name = "exact-py"


def _spice(name: str, lossless: bool, description: str) -> PolicySpec:
    """A SPICE variant: deep prediction from the sidecar's draft, on any planner."""
    return PolicySpec(
        name,
        "python",
        lossless,
        description,
        True,
        partial(SpicePolicy, name),
        reads_sidecar=True,
        inputs=IDS_AND_HIDDEN,
        asynchronous=True,
    )


_SPECS: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in (
        PolicySpec("stock", "stock", True, "hook unregistered: upstream's graph, the reference"),
        PolicySpec("exact", "native", True, "every routed expert executed exactly by libspice"),
        PolicySpec(
            AUTO,
            "auto",
            True,
            "the fastest lossless policy for this machine, model and tier, as the simulator ranks "
            "them (a probe and a routing sample on first use)",
        ),
        PolicySpec(
            "exact-py",
            "python",
            True,
            "exact, decided by a Python pass-through policy",
            factory=ExactPassThrough,
        ),
        PolicySpec(
            "host", "rule", True, "every routed expert on the host (llama.cpp --cpu-moe)", factory=HostOnly
        ),
        PolicySpec(
            "static", "rule", True, "whole layers resident up to the budget (--n-cpu-moe)", True, StaticLayers
        ),
        PolicySpec("ondemand", "rule", True, "fetch each miss synchronously, keep nothing", True, OnDemand),
        PolicySpec(
            "lru", "rule", True, "slot cache, LRU eviction, synchronous fetch on miss", True, LruCache
        ),
        # the next layer's gate applied to this layer's hidden row
        PolicySpec(
            "adapmoe",
            "rule",
            True,
            "next-layer gate prefetch, per-layer caches by miss cost",
            True,
            AdapMoE,
            inputs=IDS_AND_HIDDEN,
            without_hidden="runs without prefetch: its per-layer caches, sized by miss cost, alone",
        ),
        _spice("spice", True, "SPICE at its default quality level (spice:exact)"),
        _spice("spice:exact", True, "SPICE: deep prefetch + cost-aware fetch-or-host, lossless"),
        _spice(
            "spice:balanced",
            False,
            "SPICE, lossy: 4-bit slots, surrogates for low-weight misses (<= +1% ppl)",
        ),
        _spice("spice:fast", False, "SPICE, lossy: 4-bit slots, more surrogate substitution (<= +5% ppl)"),
        *(_spice(name, True, text) for name, text in ABLATION_DESCRIPTIONS.items()),
    )
}

# llama.cpp's own rows (bench runs them as plain llama.cpp, the simulator prices them
# from a record's placement, pyspice.sim.upstream): named here, below both
UPSTREAM = "upstream"
UPSTREAM_NCMOE = "upstream-ncmoe"
UPSTREAM_CPU_EXPS = "upstream-cpu-exps"
UPSTREAM_ROWS = (UPSTREAM, UPSTREAM_NCMOE, UPSTREAM_CPU_EXPS)
ALL_LAYERS_NGL = 99  # -ngl 99: every layer's weights on the GPU

# Rows `pyspice sim --policies` runs besides the policies: what no engine of ours runs,
# modelled in the simulator alone (pyspice.sim.upstream), by name and what it stands for
UPSTREAM_MOECACHE = "upstream-moecache"
SIM_ONLY_ROWS: Mapping[str, str] = {
    UPSTREAM_MOECACHE: "upstream llama.cpp's GPU cache of host-held experts (--moe-cache-mib): "
    "per-layer LRU banks, misses uploaded after a synchronous readback of the router's ids "
    "(simulated, not checked against a measured row)",
}

# decided in libspice with no Python per hook call (stock: nothing to decide)
NATIVE_POLICIES = frozenset(name for name, spec in _SPECS.items() if spec.kind not in ("python", "auto"))


def policy_names() -> list[str]:
    return list(_SPECS)


def policy_spec(name: str) -> PolicySpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(_SPECS)}") from None


def make_policy(
    name: str,
    levels: Mapping[str, SurrogateThresholds] | None = None,
    note: Callable[[str], None] | None = None,
) -> Policy | RulePolicy | None:
    """The policy object of a python or rule policy; None for stock and native ones.
    `levels`: the model's tuned surrogate thresholds (its sidecar's), which a lossy
    SPICE level takes over the shared ones; where they are missing, `note` says so
    (config.level_config)."""
    spec = policy_spec(name)
    if name in QUALITY_LEVELS and levels is not None:
        return SpicePolicy(level_config(name, levels, note))
    return spec.make()
