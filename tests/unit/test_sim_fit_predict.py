"""`pyspice sim fit` and `--predict`: costs read off a bench record, and the simulator
replaying that record's run with them.

The record is written here from planted costs, as the engine's counters would
show them: a 3-layer DeepSeek-V2-Lite-shaped model (a dense layer, then two MoE
layers), `exact` with the first MoE layer resident (every expert on the
device) and the second on the host, and `stock`. A fit must read the planted
costs back, and a prediction of the same run with them must give its TPOT.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyspice.cli.main import main
from pyspice.sim.fit import fit_terms, fitted_profile
from pyspice.sim.hardware import HardwareProfile, load_profile
from pyspice.sim.predict import predict_run
from pyspice.sim.records import read_records, select_runs
from pyspice.sim.targets import load_target
from pyspice.sim.workload import Workload

TARGET = load_target("deepseek-v2-lite:Q4_K_M", 3)
K = TARGET.n_expert_used
GAP, STEP, HOST_ACT, HOST_CALL, DEV_CALL, HOOK, STORE, POLICY, STOCK_LAYER = (
    150.0, 200.0, 80.0, 15.0, 60.0, 5.0, 1.5, 0.5, 100.0,
)  # fmt: skip
N_DECODE = 20


def _layer(host: float, gap: float, exec_us: float, launch: float) -> dict[str, object]:
    per_call = {
        "hook_us": exec_us + launch + STORE + POLICY + HOOK,
        "exec_us": exec_us,
        "gap_us": gap,
        "launch_us": launch,
        "store_us": STORE,
        "copies": 0.0,
        "launches": 1.0 if launch else 0.0,
    }
    return {
        "hook_calls": N_DECODE,
        "hit_rate": 1.0 - host / K,
        "misses": {"host": int(host * N_DECODE), "fetched": 0},
        "per_call": per_call,
    }


def _record(path: Path) -> float:
    """A bench record of the planted costs; returns exact's TPOT in ms."""
    mean_expert = sum(TARGET.expert_bytes[il] for il in TARGET.moe_layers) / len(TARGET.moe_layers)
    read_us = mean_expert / (load_profile("h200-vm16")["device_mem_gbps"] * 1e3)
    dev = _layer(0, 0.0, DEV_CALL + K * read_us - 20.0, 20.0)  # the first hook call has no gap before it
    host = _layer(K, GAP, HOST_CALL + K * HOST_ACT, 0.0)
    layers = {"1": dev, "2": host}
    in_hooks = sum(float(x["per_call"]["hook_us"]) for x in layers.values())  # type: ignore[index]
    exact_ms = (STEP + TARGET.n_layers * GAP + in_hooks) / 1e3
    stock_ms = (STEP + TARGET.n_layers * GAP + 2 * (STOCK_LAYER + HOST_CALL + K * HOST_ACT)) / 1e3
    exact = {
        "tpot_ms": exact_ms,
        "hook_calls": 2 * N_DECODE,
        "activations": 2 * N_DECODE * K,
        "decode_hit_rate": 0.5,
        "policy_us_per_decode_call": POLICY,
        "per_call_decode": {"hook_us": in_hooks / 2, "exec_us": 0.0, "launch_us": 10.0, "store_us": STORE,
                            "copies": 0.0, "launches": 0.5},
        "layers": layers,
        "device_bytes": {"slots": 64 * max(TARGET.expert_bytes)},
        "bytes_per_token": 0.0,
        "stall_ms_per_token": 0.0,
        "planning": {"asynchronous": False},
    }  # fmt: skip
    # per_call_decode's means, as the engine writes them
    exact["per_call_decode"]["exec_us"] = sum(float(x["per_call"]["exec_us"]) for x in layers.values()) / 2  # type: ignore[index]
    doc = {
        "model": "/not/here.gguf",
        "prompt_tokens": 64,
        "n_predict": N_DECODE + 1,
        "threads": 15,
        "replay_routing": None,
        "policies": {"stock": {"tpot_ms": stock_ms, "hook_calls": 0}, "exact": exact},
    }
    path.write_text(json.dumps(doc) + "\n" + json.dumps(doc) + "\n")
    return exact_ms


def _workload() -> Workload:
    rng = np.random.default_rng(1)
    ids = np.stack([rng.permutation(TARGET.n_expert)[:K] for _ in range(N_DECODE * 2)]).reshape(
        N_DECODE, 2, K
    )
    return Workload.from_arrays(TARGET.n_layers, TARGET.moe_layers, TARGET.n_expert, ids)


def test_the_fit_reads_the_planted_costs_back(tmp_path: Path) -> None:
    _record(tmp_path / "r.json")
    runs = read_records(tmp_path / "r.json")
    assert [r.source.rsplit(":", 1)[1] for r in runs] == ["1", "2"]
    assert runs[0].rows["exact"].slots_bytes == 64 * max(TARGET.expert_bytes)
    assert not runs[0].rows["stock"].hooked
    terms = {t.key: t for t in fit_terms(runs[:1], TARGET, load_profile("h200-vm16"))}
    assert terms["host_mem_gbps"].value == pytest.approx(
        sum(TARGET.expert_bytes[1:]) / 2 / HOST_ACT / 1e3, rel=1e-6
    )
    assert terms["host_call_us"].value == pytest.approx(HOST_CALL)
    assert terms["device_call_us"].value == pytest.approx(DEV_CALL, rel=1e-6)
    assert terms["step_us"].value == pytest.approx(STEP, rel=1e-6)
    assert terms["stock_layer_us"].value == pytest.approx(STOCK_LAYER, rel=1e-6)
    assert terms["hook_us"].value == pytest.approx(HOOK + STORE, rel=1e-6)
    # nothing in the record copies while the host works: kept from the base, and said so
    assert not terms["bus_host_slowdown"].fitted and "kept from h200-vm16" in terms["bus_host_slowdown"].note


def test_a_prediction_of_the_fitted_run_gives_its_tpot(tmp_path: Path) -> None:
    exact_ms = _record(tmp_path / "r.json")
    runs = select_runs([f"{tmp_path / 'r.json'}:1"])
    profile = HardwareProfile.from_json(fitted_profile(runs, TARGET, load_profile("h200-vm16"), "planted"))
    assert profile.deciding_us == {"exact": POLICY}
    preds = {p.row: p for p in predict_run(runs[0], _workload(), profile, TARGET)}
    assert preds["exact"].predicted_hit == pytest.approx(0.5)  # the first MoE layer preloaded, the second not
    assert preds["exact"].predicted_ms == pytest.approx(exact_ms, rel=0.01)
    assert preds["stock"].predicted_ms == pytest.approx(runs[0].rows["stock"].tpot_ms, rel=0.01)
    assert abs(preds["exact"].error or 1.0) < 0.01


def test_a_row_the_routing_cannot_replay_says_why(tmp_path: Path) -> None:
    _record(tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text().splitlines()[0])
    doc["policies"]["adapmoe"] = dict(doc["policies"]["exact"])
    doc["policies"]["upstream-ncmoe"] = {"tpot_ms": 1.0, "hook_calls": 0}
    (tmp_path / "r2.json").write_text(json.dumps(doc) + "\n")
    runs = read_records(tmp_path / "r2.json")
    profile = HardwareProfile.from_json(fitted_profile(runs, TARGET, load_profile("h200-vm16"), "p"))
    preds = {p.row: p for p in predict_run(runs[0], _workload(), profile, TARGET)}
    assert preds["adapmoe"].predicted_ms is None and "hidden rows" in preds["adapmoe"].note
    assert preds["upstream-ncmoe"].predicted_ms is None and "llama.cpp" in preds["upstream-ncmoe"].note


def test_sim_fit_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _record(tmp_path / "r.json")
    out = tmp_path / "fitted.json"
    rc = main(["sim", "fit", f"{tmp_path / 'r.json'}:1", "-o", str(out),
               "--target", "deepseek-v2-lite:Q4_K_M", "--target-layers", "3"])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["name"] == "fitted" and doc["values"]["step_us"]["source"] == "measured"
    assert "stock_layer_us" in capsys.readouterr().out
    load_profile(str(out))  # a profile `sim --profile` takes


def test_bad_records_name_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"policies": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.json:2: not a JSON document"):
        read_records(bad)
    bad.write_text('{"rows": []}\n')
    with pytest.raises(ValueError, match=r"bad.json:1: no 'policies' object"):
        read_records(bad)
    _record(tmp_path / "good.json")
    with pytest.raises(ValueError, match="no bench run on line"):
        select_runs([f"{tmp_path / 'good.json'}:7"])
    assert main(["sim", "fit", str(tmp_path / "good.json"), "-o", str(tmp_path / "x.json")]) != 0
    assert "is not here to size: give --target" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_record_keeps_the_tier_and_cost_profile_bench_wrote(tmp_path: Path) -> None:
    _record(tmp_path / "r.json")
    (old, _) = read_records(tmp_path / "r.json")
    assert old.tier is None and old.cost_profile is None  # a record from before bench kept them
    doc = json.loads((tmp_path / "r.json").read_text().splitlines()[0])
    doc["tier"] = {"budget": "25%", "budget_bytes": 100, "expert_bytes": 400, "emulated": True}
    doc["cost_profile"] = "/cache/profiles/m.json"
    (tmp_path / "t.json").write_text(json.dumps(doc) + "\n")
    (run,) = read_records(tmp_path / "t.json")
    assert run.tier is not None and run.tier["budget"] == "25%" and run.tier["emulated"] is True
    assert run.cost_profile == "/cache/profiles/m.json"
