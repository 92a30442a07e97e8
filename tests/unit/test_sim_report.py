"""Target sizes, shipped profiles, the result rows and the validation comparison."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyspice.policy.rows import parse_row, parse_rows
from pyspice.sim.hardware import Value, load_profile, policy_profile, profile_names, target_costs
from pyspice.sim.report import SimConfig, format_tables, simulate_all
from pyspice.sim.targets import load_target, use_more_bits
from pyspice.sim.validate import compare, format_comparison, parse_compare
from pyspice.sim.workload import Workload


def test_qwen2_57b_q5_k_m_expert_bytes_follow_the_k_m_mix() -> None:
    t = load_target("qwen2-57b-a14b:Q5_K_M")
    # gate and up: 2560 rows of 3584 in Q5_K (176 bytes per 256); down: 3584 rows of 2560,
    # Q6_K (210 per 256) on the layers use_more_bits picks, Q5_K elsewhere
    q5 = 2560 * 14 * 176
    assert t.expert_bytes[0] == 2 * q5 + 3584 * 10 * 210
    assert t.expert_bytes[3] == 3 * q5
    assert [use_more_bits(i, 28) for i in range(6)] == [True, True, True, False, False, True]
    assert len(t.moe_layers) == 28 and t.n_expert == 64 and t.n_expert_used == 8


def test_deepseek_v2_lite_down_rows_fall_back_and_layer_0_is_dense() -> None:
    t = load_target("deepseek-v2-lite:Q4_K_M")
    assert t.expert_bytes[0] == 0 and t.moe_layers[0] == 1
    # gate/up Q4_K (144 per 256); down rows of 1408 are not multiples of 256: Q5_0 (22 per 32)
    # or Q8_0 (34 per 32) where Q6_K was chosen
    gate_up = 2 * 1408 * 8 * 144
    assert t.expert_bytes[3] == gate_up + 2048 * 44 * 22
    assert t.expert_bytes[1] == gate_up + 2048 * 44 * 34


def test_shipped_profiles_load_and_label_every_value() -> None:
    names = profile_names()
    assert {"rtx4060", "rtx5090", "a800", "h200", "emulated"} <= set(names)
    for name in names:
        if name == "emulated":
            continue
        prof = load_profile(name)
        for v in prof.values.values():
            assert v.source in ("measured", "derived", "published", "estimate")
            if v.source == "derived":
                assert v.peak is not None and v.efficiency is not None
                assert v.value == pytest.approx(v.peak * v.efficiency)
    with pytest.raises(ValueError, match="unknown hardware profile"):
        load_profile("gtx480")
    with pytest.raises(ValueError, match="peak and efficiency"):
        Value.parse("bus_gbps", {"source": "derived", "value": 3})


def small_workload() -> Workload:
    rng = np.random.default_rng(3)
    ids = np.stack([[rng.choice(16, 2, replace=False) for _ in range(4)] for _ in range(20)]).astype(np.int32)
    return Workload.from_arrays(4, [0, 1, 2, 3], 16, ids, prompt_tokens=4)


def test_target_mapping_keeps_the_targets_per_expert_and_per_layer_ratios() -> None:
    t = load_target("qwen2-57b-a14b:Q5_K_M")
    prof = load_profile("rtx4060")
    wl = small_workload()
    costs = target_costs(prof, t, wl)
    assert set(costs.expert_bytes) <= set(t.expert_bytes)
    assert costs.expert_bytes[0] == t.expert_bytes[0] and costs.expert_bytes[3] == t.expert_bytes[27]
    assert costs.layer_scale == pytest.approx(28 / 4)
    # policies are told the simulated machine's costs, as `pyspice probe` would measure them there
    told = policy_profile(prof, costs)
    assert told.bus_gbps == prof["bus_gbps"] and told.device_source == "simulated: rtx4060"
    host_us = costs.host_expert_us[0][1]
    assert host_us == pytest.approx(
        sum(t.expert_bytes) / 28 / (prof["host_mem_gbps"] * 1e3)
    )  # memory-bound decode on the host


def test_rows_have_every_policy_and_a_belady_row(tmp_path: Path) -> None:
    wl = small_workload()
    cfg = SimConfig(
        profiles=(load_profile("rtx4060"), load_profile("a800")),
        budgets=("25%", "50%"),
        policies=tuple(parse_rows("host,lru,ondemand")),
        target=load_target("qwen2-57b-a14b:Q5_K_M"),
        source_expert_bytes=(1000,) * 4,
        policy_us={"host": 10.0, "lru": 20.0, "ondemand": 20.0},
    )
    rows = simulate_all(wl, cfg)
    assert len(rows) == 2 * 2 * 4
    assert [r["policy"] for r in rows[:4]] == ["host", "lru", "ondemand", "belady"]
    assert all(r["simulated"] for r in rows)
    table = format_tables(rows)
    assert "belady" in table and "(simulated)" in table
    # a 25% budget of Qwen2-57B plus its other weights does not fit an 8 GiB card: said so
    assert any("GiB" in r.get("note", "") for r in rows if r["profile"] == "rtx4060")
    bench = tmp_path / "bench.json"
    lru_ms = rows[1]["tpot_ms"]
    bench.write_text(json.dumps({"policies": {"lru": {"tpot_ms": 0.0, "tpot_ms_runs": [lru_ms * 1.1] * 2}}}))
    other = tmp_path / "bench2.json"
    other.write_text(json.dumps({"policies": {"lru": {"tpot_ms": 0.0, "tpot_ms_runs": [lru_ms * 1.1, 1e9]}}}))
    entries = compare(rows, parse_compare(f"25%={bench}+{other}"))
    assert len(entries) == 2  # lru at 25% on both profiles
    assert entries[0]["error"] == pytest.approx(1 / 1.1 - 1)  # median of the four pooled repeats
    assert "tolerance" in format_comparison(entries)
    with pytest.raises(ValueError, match="stock"):
        simulate_all(wl, SimConfig(cfg.profiles, ("25%",), (parse_row("stock"),), cfg.target, (1000,) * 4))


def test_cli_shows_profiles_and_asks_for_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    from pyspice.cli.main import main

    assert main(["sim", "--profile", "a800,rtx4060", "--show-profiles"]) == 0
    out = capsys.readouterr().out
    assert "a800:" in out and "rtx4060:" in out and "derived: 31.5 peak x 0.8" in out
    assert main(["sim", "--profile", "a800"]) != 0
    assert "--trace" in capsys.readouterr().err


def _tiny_moe(path: Path, *, tied: bool) -> Path:
    """Two MoE layers of 4 experts (3 neurons, 8 wide), F32: every size is known by hand."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, "qwen2moe")
    w.add_uint32("qwen2moe.block_count", 2)
    w.add_uint32("qwen2moe.expert_count", 4)
    w.add_uint32("qwen2moe.expert_used_count", 2)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    if not tied:
        w.add_tensor("output.weight", np.zeros((12, 8), np.float32))
    for il in range(2):
        w.add_tensor(f"blk.{il}.attn_q.weight", np.zeros((8, 8), np.float32))
        w.add_tensor(f"blk.{il}.ffn_gate_inp.weight", np.zeros((4, 8), np.float32))
        for part in ("gate", "up"):
            w.add_tensor(f"blk.{il}.ffn_{part}_exps.weight", np.zeros((4, 3, 8), np.float32))
        w.add_tensor(f"blk.{il}.ffn_down_exps.weight", np.zeros((4, 8, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_source_target_reads_the_recorded_models_own_sizes(tmp_path: Path) -> None:
    from pyspice.sim.targets import source_target

    t = source_target(_tiny_moe(tmp_path / "m.gguf", tied=False))
    assert t.moe_layers == (0, 1) and t.n_expert == 4 and t.n_expert_used == 2
    assert t.expert_bytes == (3 * 3 * 8 * 4,) * 2  # gate, up, down of 3x8 F32 each
    assert t.expert_params == 3 * 3 * 8
    assert t.layer_bytes == ((64 + 32) * 4,) * 2 and t.layer_params == (96, 96)  # attn_q + router
    assert t.head_bytes == 12 * 8 * 4
    assert source_target(_tiny_moe(tmp_path / "tied.gguf", tied=True)).head_bytes == 10 * 8 * 4


def test_a_hardware_profile_simulates_the_source_models_own_sizes(tmp_path: Path) -> None:
    """`sim --target source --profile rtx4060` once failed with "needs --target": 'source'
    meant no target at all, which only the emulated profile can do without."""
    from pyspice.sim.targets import source_target

    target = source_target(_tiny_moe(tmp_path / "m.gguf", tied=False))
    wl = Workload.from_arrays(
        2, [0, 1], 4, np.tile(np.array([[0, 1], [2, 3]], np.int32), (12, 1, 1)), prompt_tokens=4
    )
    cfg = SimConfig((load_profile("rtx4060"),), ("50%",), (parse_row("lru"),), target, target.expert_bytes)
    rows = simulate_all(wl, cfg)
    assert [r["policy"] for r in rows] == ["lru", "belady"]
    assert rows[0]["target"] == "source:m.gguf" and rows[0]["tpot_ms"] > 0
    assert target_costs(load_profile("rtx4060"), target, wl).expert_bytes == target.expert_bytes
    with pytest.raises(ValueError, match="--target source"):
        simulate_all(wl, SimConfig(cfg.profiles, ("50%",), cfg.policies, None, target.expert_bytes))


def test_rows_may_say_where_a_spice_policy_plans() -> None:
    cfg = SimConfig(
        profiles=(load_profile("rtx4060"),),
        budgets=("50%",),
        # the long form of a plan is the same row, named as rows were always recorded
        policies=tuple(parse_rows("spice:exact@sync,spice:exact@plan=async,spice:exact@det2")),
        target=load_target("qwen2-57b-a14b:Q5_K_M"),
        source_expert_bytes=(1000,) * 4,
    )
    rows = {r["policy"]: r for r in simulate_all(small_workload(), cfg)}
    assert rows["spice:exact@sync"]["planning"]["applied"] == 0
    assert rows["spice:exact@async"]["planning"]["applied"] > 0
    assert rows["spice:exact@det2"]["planning"]["lag_layers"] == 2
    with pytest.raises(ValueError, match="'later' is not a key=value"):
        parse_row("lru@later")
    own_budget = SimConfig(cfg.profiles, ("50%",), (parse_row("lru@ram=25%"),), cfg.target, (1000,) * 4)
    with pytest.raises(ValueError, match="the same for every row"):
        simulate_all(small_workload(), own_budget)


def test_rows_of_a_level_with_low_precision_slots_say_the_simulator_does_not_model_them() -> None:
    cfg = SimConfig(
        profiles=(load_profile("h200"),),
        budgets=("25%",),
        policies=tuple(parse_rows("lru,spice:balanced,spice:fast")),
        target=load_target("qwen2-57b-a14b:Q5_K_M"),
        source_expert_bytes=(1000,) * 4,
    )
    rows = simulate_all(small_workload(), cfg)
    notes = {r["policy"]: r.get("note", "") for r in rows}
    assert "5bit slots not modelled" in notes["spice:balanced"] and notes["lru"] == ""
    assert "4bit slots not modelled" in notes["spice:fast"]
