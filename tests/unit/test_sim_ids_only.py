"""`pyspice sim` on a trace of routing alone: no model, hand-computed LRU and MIN,
SPICE with the routing-history predictor, and clear refusals of what the trace lacks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from pyspice.cli import sim_cmd, trace_fit_cmd
from pyspice.policy.spice.history_lookahead import HistoryLookahead
from pyspice.policy.spice.routing_history import fit
from pyspice.sim.workload import from_trace
from tests.unit.test_regime import write_trace

# one MoE layer of 4 experts, top-1; at 50% the tier holds 2 experts
STREAM = [0, 1, 0, 2, 1, 0, 2, 2]
# LRU of 2: hits at t2 (0) and t7 (2) only
LRU_HITS = 2 / 8
# MIN of 2: t3 evicts 0 (back at t5) before 1 (back at t4), t5 evicts 1 (never back):
# hits at t2, t4, t6, t7
MIN_HITS = 4 / 8


def _sim(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["sim", *argv])
    return int(args.func(args))


def _tiny(tmp_path: Path) -> Path:
    ids = np.array(STREAM, dtype=np.int32).reshape(-1, 1, 1)
    return write_trace(tmp_path / "tiny", ids, 4, starts=[0, 4])


def _sim_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, object]]:
    assert _sim([*argv, "--json"]) == 0
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)["rows"]
    return rows


def test_lru_and_min_match_the_hand_count_without_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _tiny(tmp_path)
    rows = _sim_json(
        capsys,
        [
            "--trace", str(trace), "--target", "deepseek-v2-lite:Q4_K_M", "--profile", "h200",
            "--device-budget", "50%", "--policies", "lru,static,exact",
        ],
    )  # fmt: skip
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"lru", "static", "exact", "belady"}
    for row in rows:
        for key in ("profile", "budget", "policy", "tpot_ms", "hit_rate"):
            assert key in row
    assert by["lru"]["hit_rate"] == pytest.approx(LRU_HITS)
    assert by["belady"]["hit_rate"] == pytest.approx(MIN_HITS)
    assert all(r["decoded_tokens"] == len(STREAM) for r in rows)


def test_sequences_replay_a_part_of_the_trace(tmp_path: Path) -> None:
    trace = _tiny(tmp_path)
    assert from_trace(trace, (2, 2)).decoded_tokens == 4
    assert [int(s.calls[0].ids[0, 0]) for s in from_trace(trace, (2, 2)).steps] == STREAM[4:]
    with pytest.raises(ValueError, match="outside the trace's 1-2"):
        from_trace(trace, (2, 3))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "spice"], "pyspice trace fit"),
        (["--target", "source"], "no model file to size"),
        (["--profile", "emulated"], "replays on this machine's copy"),
    ],
)
def test_what_the_trace_lacks_is_refused_clearly(tmp_path: Path, argv: list[str], message: str) -> None:
    base = {"--target": "deepseek-v2-lite:Q4_K_M", "--profile": "h200", "--policies": "lru"}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    flat = [x for kv in base.items() for x in kv]
    with pytest.raises(ValueError, match=message):
        _sim(["--trace", str(_tiny(tmp_path)), *flat])


def test_adapmoe_says_what_it_falls_back_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _tiny(tmp_path)
    assert _sim(["--trace", str(trace), "--target", "deepseek-v2-lite:Q4_K_M",
                 "--profile", "h200", "--policies", "adapmoe", "--json"]) == 0  # fmt: skip
    assert "runs without prefetch" in capsys.readouterr().err


def _planted(tmp_path: Path) -> tuple[Path, np.ndarray]:
    # 16 experts in 4 blocks of 4 (top-4); each MoE layer picks the block after the last one's
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 4, size=400)
    ids = np.stack([((blocks[:, None] + j) % 4) * 4 + np.arange(4) for j in range(4)], axis=1)
    ids = ids.astype(np.int32)
    return write_trace(tmp_path / "planted", ids, 16, starts=list(range(0, 400, 40))), ids


def test_the_lookahead_predicts_a_planted_rule_from_ids(tmp_path: Path) -> None:
    _path, ids = _planted(tmp_path)
    first = np.zeros(len(ids), dtype=bool)
    first[::40] = True
    look = HistoryLookahead(fit(ids, first, 16, max_depth=2), [1, 2, 3, 4])
    rolled = look.rollout_logits(1, ids[7, 0], 3)  # the predictor's depth caps the 3
    assert [layer for layer, _ in rolled] == [2, 3]
    for d, (_layer, logits) in enumerate(rolled, 1):
        assert set(np.argsort(-logits)[:4].tolist()) == set(ids[7, d].tolist())
    batch = look.rollout_logits(3, ids[:5, 2], 2)  # two layers left after MoE layer 3
    assert [layer for layer, _ in batch] == [4] and batch[0][1].shape == (5, 16)
    assert look.rollout_logits(4, ids[0, 3], 2) == []  # the last MoE layer: nothing ahead


def test_fit_then_spice_runs_on_the_held_out_sequences(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, _ids = _planted(tmp_path)
    npz = tmp_path / "history.npz"
    parser = argparse.ArgumentParser()
    trace_fit_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["fit", str(trace), "-o", str(npz), "--fit-sequences", "8", "--json"])
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["test_sequences"] == [9, 10] and doc["recall"]["1"] == 1.0
    rows = _sim_json(
        capsys,
        [
            "--trace", str(trace), "--sequences", "9-10", "--target", "deepseek-v2-lite:Q4_K_M",
            "--profile", "h200", "--device-budget", "50%", "--policies", "lru,spice",
            "--history-predictor", str(npz),
        ],
    )  # fmt: skip
    by = {r["policy"]: r for r in rows}
    assert by["spice"]["decoded_tokens"] == 80
    assert by["spice"]["prefetch_issued"] > 0  # type: ignore[operator]
    # a rule SPICE predicts exactly: its prefetches are used, so it hits more than lru
    assert by["spice"]["hit_rate"] > by["lru"]["hit_rate"]  # type: ignore[operator]
