"""The ranking `--policy auto` chooses by: lossless candidates ordered by simulated
TPOT, the order following the hardware, and the defaults that make auto the choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyspice.engine.config import RunConfig
from pyspice.sim.rank import rank_lossless

from .test_simulator import N_EXPERT, N_LAYERS, costs, workload

CANDIDATES = ("exact", "static", "lru", "adapmoe", "spice")
QUARTER = N_LAYERS * N_EXPERT * 10_000 // 4  # a tier of a quarter of the experts


def test_ranking_is_sorted_and_says_what_it_left_out() -> None:
    ranking = rank_lossless(workload(), costs(), QUARTER, CANDIDATES)
    times = [r.tpot_ms for r in ranking.rows]
    assert times == sorted(times) and ranking.best.tpot_ms == times[0]
    assert ranking.runner_up is not None and ranking.runner_up.tpot_ms >= ranking.best.tpot_ms
    left = dict(ranking.left_out)
    assert "predictor" in left["spice"]  # no sidecar, no routing-history predictor
    assert "hidden rows" in left["adapmoe"]  # a workload of ids alone
    assert {r.row for r in ranking.rows} == {"exact", "static", "lru"}


def test_the_choice_follows_the_hardware() -> None:
    # a fast bus and a slow host: fetching misses beats running them on the host
    fast_bus = rank_lossless(workload(), costs(host_expert_us=((1, 200.0),)), QUARTER, ("exact", "lru"))
    assert fast_bus.best.row == "lru"
    # a bus that takes a millisecond per copy: the preloaded tier and the host win
    slow_bus = rank_lossless(
        workload(), costs(bus_latency_us=1000.0, host_expert_us=((1, 5.0),)), QUARTER, ("exact", "lru")
    )
    assert slow_bus.best.row == "exact"


def test_a_lossy_candidate_is_refused() -> None:
    with pytest.raises(ValueError, match="lossless policies only; spice:fast"):
        rank_lossless(workload(), costs(), QUARTER, ("exact", "spice:fast"))


def test_auto_is_the_default_wherever_there_is_a_tier(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert RunConfig(model, device_budget="50%").default_policy() == "auto"
    assert RunConfig(model, ram_budget="50%").default_policy() == "auto"
    assert RunConfig(model).default_policy() == "exact"  # this machine: no GPU, no tier
    assert RunConfig(model, policy="lru", device_budget="50%").default_policy() == "lru"


def _rec(run: str, row: str, budget: str, measured: float, predicted: float | None) -> dict[str, object]:
    return {"run": run, "row": row, "budget": budget, "measured_ms": measured, "predicted_ms": predicted,
            "lossless": True}  # fmt: skip


def test_picks_on_records_score_the_least_predicted_candidate_by_its_measurement() -> None:
    rows = [
        _rec("a:1", "upstream-ncmoe", "", 4.0, None),
        _rec("a:1", "exact", "25%", 4.2, 4.0),
        _rec("a:1", "lru", "25%", 4.0, 4.5),  # measured best, predicted worse: the pick misses it
        _rec("a:1", "spice:exact@sync", "25%", 5.0, 3.0),  # not a candidate: auto plans as the default
        _rec("a:2", "exact", "50%", 3.0, 3.0),  # one candidate: nothing to choose
    ]
    from pyspice.sim.rank import picks_on_records

    (pick,) = picks_on_records(rows)
    assert (pick["run"], pick["pick"], pick["best"]) == ("a:1", "exact", "lru")
    assert pick["over_best"] == pytest.approx(4.2 / 4.0)
    assert pick["over_ncmoe"] == pytest.approx(4.2 / 4.0)
    assert pick["candidates"] == ["exact", "lru"]


def test_a_probe_swamped_by_other_work_is_not_trusted() -> None:
    from pyspice.engine.auto_policy import plausible
    from pyspice.policy.profile import PROFILE_VERSION, BatchCost, CostProfile

    def probe(one_token_us: float) -> CostProfile:
        batches = [BatchCost(1, one_token_us, 100.0), BatchCost(8, 3.0, 50.0)]
        return CostProfile(
            PROFILE_VERSION, "m.gguf", "", 2, 4, 4, {"Q8_0": 1}, 12.0, 10.0, "emulated",
            one_token_us, "emulated", batches,
        )  # fmt: skip

    assert plausible(probe(7.2))
    assert not plausible(probe(0.0))  # all experts minus none came out at nothing: noise
