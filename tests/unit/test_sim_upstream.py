"""llama.cpp's own rows priced on the simulator's hardware model (pyspice.sim.upstream),
scored by `sim --predict`, and upstream's GPU expert cache as a `pyspice sim` row.

The pricing is checked against the simulator itself (an all-host placement is
stock, as the simulator prices stock) and for the way it moves: more layers'
experts on the CPU is slower, a slower host slows the host layers only. The
cache's misses are checked against a per-layer LRU counted here, by hand, on a
small trace.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pyspice.cli import sim_cmd
from pyspice.sim.fit import fitted_profile
from pyspice.sim.hardware import HardwareProfile, Value, load_profile, target_costs
from pyspice.sim.predict import format_predictions, predict_run
from pyspice.sim.records import read_records
from pyspice.sim.simulator import Simulator
from pyspice.sim.targets import load_target
from pyspice.sim.upstream import (
    NOT_CHECKED,
    device_layers,
    moecache_costs,
    moecache_result,
    placement_tpot_ms,
    price_row,
    split_free_costs,
)
from pyspice.sim.workload import Workload
from pyspice.units import slot_bytes
from tests.unit.test_regime import write_trace
from tests.unit.test_sim_fit_predict import TARGET as TARGET_3L
from tests.unit.test_sim_fit_predict import _record, _workload

TARGET = load_target("deepseek-v2-lite:Q4_K_M", 8)  # a dense layer, then 7 MoE layers
K = TARGET.n_expert_used


def _profile(**values: float) -> HardwareProfile:
    """h200-vm16 with what a fit adds (a step outside the layers, stock's own path)."""
    base = load_profile("h200-vm16")
    got = dict(base.values)
    for key, value in {"step_us": 200.0, "stock_layer_us": 100.0, **values}.items():
        got[key] = Value(value, "measured", "planted")
    return replace(base, values=got)


def _decode(n_tokens: int, n_expert: int = 16, seed: int = 0) -> Workload:
    """Decode steps of TARGET's geometry picking among its first `n_expert` experts alone,
    so that a cache hits."""
    rng = np.random.default_rng(seed)
    moe = TARGET.moe_layers
    ids = np.stack([[rng.permutation(n_expert)[:K] for _ in moe] for _ in range(n_tokens)])
    return Workload.from_arrays(TARGET.n_layers, moe, TARGET.n_expert, ids)


def _stock_ms(profile: HardwareProfile, wl: Workload) -> float:
    costs = target_costs(profile, TARGET, wl)
    stock = replace(costs, hook_us=costs.stock_layer_us, copy_issue_us=0.0, python_call_us=0.0)
    return Simulator(wl, stock, 0).run("stock", None, policy_us=0.0).tpot_ms


def _tpot(profile: HardwareProfile, wl: Workload, on_device: set[int]) -> float:
    costs = target_costs(profile, TARGET, wl)
    return placement_tpot_ms(costs, split_free_costs(profile, TARGET, wl), wl, frozenset(on_device))


def test_every_expert_on_the_host_is_stock_as_the_simulator_prices_it() -> None:
    profile, wl = _profile(), _decode(12)
    assert _tpot(profile, wl, set()) == pytest.approx(_stock_ms(profile, wl), rel=1e-6)
    # another profile, another answer: the equality is not a constant
    slow = _profile(host_mem_gbps=20.0, stock_layer_us=300.0)
    assert _tpot(slow, wl, set()) == pytest.approx(_stock_ms(slow, wl), rel=1e-6)
    assert _tpot(slow, wl, set()) > 1.5 * _tpot(profile, wl, set())


def test_ncmoe_with_more_layers_on_the_cpu_is_slower() -> None:
    profile, wl = _profile(), _decode(8)
    moe = list(wl.moe_layers)
    times = [_tpot(profile, wl, set(moe[n:])) for n in range(len(moe) + 1)]  # n = --n-cpu-moe
    assert all(a < b for a, b in itertools.pairwise(times)), times
    # every layer moved saves the same (every MoE layer is priced alike) ...
    steps = np.diff(times[1:])
    assert np.allclose(steps, steps[0], rtol=1e-6)
    # ... and none on the CPU loses the splits outside the layers too: -ngl 99 is faster
    # than the per-layer saving alone says
    assert times[0] < times[1] - steps[0]


def test_a_slower_host_slows_the_host_layers_alone() -> None:
    fast, slow, wl = _profile(), _profile(host_mem_gbps=20.0), _decode(8)
    moe = set(wl.moe_layers)
    assert _tpot(slow, wl, moe) == pytest.approx(_tpot(fast, wl, moe))  # -ngl 99: no host work
    gained = [_tpot(slow, wl, on) - _tpot(fast, wl, on) for on in (set(), {7}, {5, 6, 7})]
    assert gained[0] > gained[1] > gained[2] > 0  # the more layers on the host, the more it costs


def test_all_on_the_device_costs_the_weights_reading() -> None:
    profile, wl = _profile(), _decode(4)
    got = _tpot(profile, wl, set(wl.moe_layers))
    bw = profile["device_mem_gbps"] * 1e3
    mean_expert = sum(TARGET.expert_bytes[il] for il in TARGET.moe_layers) / len(TARGET.moe_layers)
    reading = (sum(TARGET.layer_bytes) + TARGET.head_bytes + len(TARGET.moe_layers) * K * mean_expert) / bw
    assert got == pytest.approx(reading / 1e3, rel=1e-3)  # no fitted step, no split, no executor
    # and the fitted terms that hold the hook's split do not move it
    assert _tpot(_profile(step_us=900.0, device_layer_us=400.0), wl, set(wl.moe_layers)) == pytest.approx(got)


def test_the_record_says_which_layers_were_on_the_gpu() -> None:
    wl = _decode(2)
    ncmoe = {"n_gpu_layers": 99, "n_cpu_moe": 5, "gpu_expert_layers": 3, "expert_layers": 7}
    assert device_layers("upstream-ncmoe", ncmoe, wl) == frozenset({5, 6, 7})
    assert device_layers("upstream-ncmoe", {**ncmoe, "gpu_expert_layers": 0}, wl) == frozenset()
    assert device_layers("upstream", {"n_gpu_layers": 99, "overrides": []}, wl) == frozenset(wl.moe_layers)
    cpu_exps = {"n_gpu_layers": 99, "overrides": ["exps=CPU"]}
    assert device_layers("upstream-cpu-exps", cpu_exps, wl) == frozenset()
    assert "not in the record" in str(device_layers("upstream", None, wl))
    assert "not modelled" in str(device_layers("upstream", {"n_gpu_layers": 0}, wl))
    costs = target_costs(_profile(), TARGET, wl)
    priced = price_row("upstream-ncmoe", None, costs, split_free_costs(_profile(), TARGET, wl), wl)
    assert priced.tpot_ms is None and "llama.cpp" in priced.note


def _upstream_record(path: Path) -> Path:
    """test_sim_fit_predict's record (3 layers: dense, then 2 MoE) with llama.cpp's rows."""
    _record(path)
    doc = json.loads(path.read_text().splitlines()[0])
    stock = doc["policies"]["stock"]["tpot_ms"]
    doc["policies"] |= {
        "upstream": {"tpot_ms": 0.05 * stock, "hook_calls": 0},
        "upstream-ncmoe": {"tpot_ms": 0.8 * stock, "hook_calls": 0},
        "upstream-cpu-exps": {"tpot_ms": 0.97 * stock, "hook_calls": 0},
    }
    routed = TARGET_3L.routed_bytes
    doc["llama_cpp_rows"] = {
        "upstream": {"label": "upstream -ngl 99", "n_gpu_layers": 99, "overrides": [], "skipped": None},
        "upstream-ncmoe": {"label": "upstream-ncmoe N=2", "n_gpu_layers": 99, "overrides": ["blk.1"],
                           "n_cpu_moe": 2, "gpu_expert_layers": 1, "expert_layers": 2,
                           "matched_bytes": routed // 2, "skipped": None},
        "upstream-cpu-exps": {"label": "upstream -ot exps=CPU", "n_gpu_layers": 99,
                              "overrides": ["exps=CPU"], "skipped": None},
    }  # fmt: skip
    path.write_text(json.dumps(doc) + "\n")
    return path


def test_predict_scores_llama_cpp_rows_apart(tmp_path: Path) -> None:
    runs = read_records(_upstream_record(tmp_path / "r.json"))
    assert runs[0].llama_cpp["upstream-ncmoe"]["n_cpu_moe"] == 2
    profile = HardwareProfile.from_json(fitted_profile(runs, TARGET_3L, load_profile("h200-vm16"), "p"))
    preds = {p.row: p for p in predict_run(runs[0], _workload(), profile, TARGET_3L)}
    up, ncmoe, cpu = preds["upstream"], preds["upstream-ncmoe"], preds["upstream-cpu-exps"]
    assert all(p.predicted_ms is not None and p.error is not None and p.llama_cpp for p in (up, ncmoe, cpu))
    assert cpu.predicted_ratio == pytest.approx(1.0)  # repacking assumed not to change decode
    assert cpu.error == pytest.approx(1 / 0.97 - 1)
    assert (up.predicted_ratio or 0) < (ncmoe.predicted_ratio or 0) < 1.0
    assert ncmoe.budget == "50%" and "1 of 2 expert layers on the device" in ncmoe.note
    assert up.record()["llama_cpp_row"] and not preds["exact"].record()["llama_cpp_row"]
    text = format_predictions(list(preds.values()))
    assert "lossless rows predicted: 1;" in text  # exact alone: llama.cpp's rows are apart
    assert "llama.cpp's own rows predicted: 3;" in text
    assert "not our policies" in text


def _sim(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["sim", *argv])
    return int(args.func(args))


def test_sim_predict_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = _upstream_record(tmp_path / "r.json")
    runs = read_records(record)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(fitted_profile(runs, TARGET_3L, load_profile("h200-vm16"), "p")))
    ids = np.stack([s.calls[j].ids[0] for s in _workload().steps for j in range(2)]).reshape(-1, 2, K)
    trace = write_trace(tmp_path / "own", ids, TARGET_3L.n_expert)
    argv = ["--predict", str(record), "--profile", str(profile), "--target", "deepseek-v2-lite:Q4_K_M",
            "--target-layers", "3", "--trace", str(trace), "--json"]  # fmt: skip
    assert _sim(argv) == 0
    rows = {r["row"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name in ("upstream", "upstream-ncmoe", "upstream-cpu-exps"):
        assert rows[name]["predicted_ms"] is not None and rows[name]["error"] is not None
        assert rows[name]["llama_cpp_row"] is True


def _lru_misses(wl: Workload, capacity: int) -> dict[int, int]:
    """A per-layer LRU of `capacity` experts, counted by hand over the decode steps: the
    misses of each layer."""
    banks: dict[int, list[int]] = {il: [] for il in wl.moe_layers}
    misses = dict.fromkeys(wl.moe_layers, 0)
    for step in wl.steps:
        for call in step.calls:
            bank = banks[call.layer]
            chosen = list(dict.fromkeys(int(e) for e in call.ids.ravel()))
            for e in chosen:
                if e in bank:
                    bank.remove(e)
                else:
                    misses[call.layer] += 1
                    if len(bank) + 1 > capacity:
                        # least recently used first, never one this token picked
                        victim = next(x for x in bank if x not in chosen)
                        bank.remove(victim)
                bank.append(e)
    return misses


def _slot(profile: HardwareProfile, wl: Workload) -> int:
    costs = moecache_costs(profile, TARGET, wl)
    return slot_bytes(costs.expert_bytes, wl.n_expert)


@pytest.mark.parametrize("capacity", [K, K + 2, 12])
def test_moecache_misses_are_a_per_layer_lru(capacity: int) -> None:
    profile, wl = _profile(), _decode(30, seed=3)
    budget = capacity * len(wl.moe_layers) * _slot(profile, wl)
    got = moecache_result(wl, profile, TARGET, budget)
    per_layer = _lru_misses(wl, capacity)
    want = sum(per_layer.values())
    assert want > 0 and got.misses_fetched == want and got.misses_host == 0
    assert got.hits == got.activations - want
    # every miss uploaded once: its own expert's bytes
    uploaded = sum(n * TARGET.expert_bytes[il] for il, n in per_layer.items())
    assert got.bytes_per_token * wl.decoded_tokens == pytest.approx(uploaded)


def test_moecache_at_the_whole_tier_misses_each_expert_once() -> None:
    profile, once = _profile(), _decode(20, seed=5)
    twice = replace(once, steps=[*once.steps, *once.steps])  # the same tokens again: a warm cache
    whole = len(once.moe_layers) * TARGET.n_expert * _slot(profile, once)
    cold, warm = moecache_result(once, profile, TARGET, whole), moecache_result(twice, profile, TARGET, whole)
    distinct = sum(len({int(e) for s in once.steps for e in s.calls[j].ids.ravel()}) for j in range(7))
    assert cold.misses_fetched == distinct  # compulsory misses alone
    assert warm.misses_fetched == cold.misses_fetched  # the second pass: no miss ...
    uploaded = cold.bytes_per_token * once.decoded_tokens
    assert warm.bytes_per_token * twice.decoded_tokens == pytest.approx(uploaded)
    assert warm.tpot_ms < cold.tpot_ms  # ... no upload, so faster per token
    # a smaller cache misses more and runs slower
    small = moecache_result(once, profile, TARGET, whole // 8)
    assert small.misses_fetched > cold.misses_fetched and small.tpot_ms > cold.tpot_ms


def test_moecache_readback_and_cpu_share_move_it() -> None:
    wl = _decode(20, seed=7)
    whole = len(wl.moe_layers) * TARGET.n_expert * _slot(_profile(), wl)
    base = moecache_result(wl, _profile(bus_latency_us=0.0), TARGET, whole)
    late = moecache_result(wl, _profile(bus_latency_us=20.0), TARGET, whole)
    # two copies' latency per MoE layer for the readback, more per upload
    assert late.tpot_ms - base.tpot_ms >= 2 * 20.0 * len(wl.moe_layers) / 1e3
    small = whole // 4
    none = moecache_result(wl, _profile(), TARGET, small)
    half = moecache_result(wl, _profile(), TARGET, small, cpu_share=0.5)
    assert none.misses_host == 0 and half.misses_host > 0
    assert half.bytes_per_token < none.bytes_per_token  # host-run misses are not uploaded
    with pytest.raises(ValueError, match="fraction"):
        moecache_result(wl, _profile(), TARGET, small, cpu_share=1.5)
    with pytest.raises(ValueError, match="GPU hardware profile"):  # edge mode's RAM tier is no GPU
        moecache_result(wl, replace(_profile(), disk=True), TARGET, small)


def test_sim_runs_moecache_as_a_row_and_says_it_is_not_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = np.random.default_rng(0).integers(0, 8, size=(24, 2, 1)).astype(np.int32)
    trace = write_trace(tmp_path / "t", ids, 8)
    base = ["--trace", str(trace), "--target", "deepseek-v2-lite:Q4_K_M", "--profile", "h200",
            "--device-budget", "25%,100%"]  # fmt: skip
    assert _sim([*base, "--policies", "lru,upstream-moecache", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["policy"] == "upstream-moecache"]
    assert [r["budget"] for r in rows] == ["25%", "100%"]
    assert all(NOT_CHECKED in r["note"] for r in rows)
    assert rows[0]["hit_rate"] < rows[1]["hit_rate"]
    assert _sim([*base, "--policies", "upstream-moecache"]) == 0
    assert NOT_CHECKED in capsys.readouterr().out


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ("upstream-moecache@async", "takes no keys"),
        ("upstream", "unknown policy"),  # llama.cpp's measured rows are bench's, not sim's
        ("stock", "no hook to simulate"),
    ],
)
def test_sim_still_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policies: str, message: str
) -> None:
    trace = write_trace(tmp_path / "t", np.zeros((4, 1, 1), np.int32), 4)
    argv = ["--trace", str(trace), "--target", "deepseek-v2-lite:Q4_K_M", "--profile", "h200",
            "--policies", policies]  # fmt: skip
    with pytest.raises((ValueError, SystemExit)) as err:
        _sim(argv)
    shown = str(err.value) + capsys.readouterr().err
    assert message in shown
