"""`pyspice.formats.model_info`: the header-only reader and what a budget holds (no native code)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pyspice.formats.model_info import ModelFileError, format_summary, inspect_model, read_header
from pyspice.units import parse_budget

N_EMBD, N_FF, N_EXPERT = 32, 16, 4


def write_moe(path: Path, n_layers: int = 3, dense_first: int = 1, vocab: int = 300) -> Path:
    """A small deepseek2-like file: `dense_first` dense layers, then MoE layers whose
    down projections alternate F16/F32 (experts of two sizes)."""
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_block_count(n_layers)
    w.add_embedding_length(N_EMBD)
    w.add_head_count(2)  # 16-wide heads, 8 of them RoPE: what llama.cpp's deepseek2 asserts on
    w.add_rope_dimension_count(8)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(2)
    w.add_expert_shared_count(2)
    w.add_leading_dense_block_count(dense_first)
    # a long string array, as a tokenizer vocabulary is: skipped, not decoded
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, N_EMBD), np.float32))
    for il in range(n_layers):
        if il < dense_first:
            w.add_tensor(f"blk.{il}.ffn_up.weight", np.zeros((N_FF, N_EMBD), np.float32))
            continue
        down = np.float16 if il % 2 else np.float32
        w.add_tensor(f"blk.{il}.ffn_gate_exps.weight", np.zeros((N_EXPERT, N_FF, N_EMBD), np.float32))
        w.add_tensor(f"blk.{il}.ffn_up_exps.weight", np.zeros((N_EXPERT, N_FF, N_EMBD), np.float32))
        w.add_tensor(f"blk.{il}.ffn_down_exps.weight", np.zeros((N_EXPERT, N_EMBD, N_FF), down))
        w.add_tensor(f"blk.{il}.ffn_up_shexp.weight", np.zeros((2 * N_FF, N_EMBD), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_matches_the_gguf_package_reader(tmp_path: Path) -> None:
    path = write_moe(tmp_path / "m.gguf")
    header = read_header(path)
    reference = gguf.GGUFReader(path)
    assert [(t.name, t.nbytes, t.type_name) for t in header.tensors] == [
        (t.name, int(t.n_bytes), t.tensor_type.name) for t in reference.tensors
    ]
    assert header.data_offset == reference.data_offset
    assert header.metadata["deepseek2.expert_count"] == N_EXPERT
    assert header.metadata["tokenizer.ggml.tokens"].length == 300


def test_summary_experts_sizes_and_budget_fit(tmp_path: Path) -> None:
    s = inspect_model(write_moe(tmp_path / "m.gguf", n_layers=5))
    f32_expert = 3 * N_FF * N_EMBD * 4
    f16_down = 2 * N_FF * N_EMBD * 4 + N_FF * N_EMBD * 2
    assert s.architecture == "deepseek2" and s.n_layers == 5 and s.moe_layers == [1, 2, 3, 4]
    assert (s.n_expert, s.n_expert_used, s.n_shared) == (N_EXPERT, 2, 2)
    sizes = {il: g.bytes_per_expert for g in s.groups for il in g.layers}
    assert sizes == {1: f16_down, 2: f32_expert, 3: f16_down, 4: f32_expert}
    assert [g.layer_range() for g in s.groups] == ["layers 1,3", "layers 2,4"]
    assert s.expert_bytes == N_EXPERT * 2 * (f16_down + f32_expert)
    assert s.shared_expert_bytes == 4 * 2 * N_FF * N_EMBD * 4

    # a budget holding exactly the last two MoE layers: llama.cpp --n-cpu-moe 3
    two_layers = N_EXPERT * (f16_down + f32_expert)
    fit = s.fit(parse_budget(str(two_layers)))
    assert (fit.n_cpu_moe, fit.resident_layers, fit.resident_bytes) == (3, 2, two_layers)
    assert s.fit(parse_budget(str(two_layers - 1))).n_cpu_moe == 4
    # all of it: no layer keeps experts on the host (the dense one has none to keep)
    everything = s.fit(parse_budget("100%"))
    assert everything.n_cpu_moe == 0 and everything.holds == everything.experts == 4 * N_EXPERT
    assert s.fit(parse_budget("25%")).holds == N_EXPERT
    # experts of two sizes: every slot is the larger one's, and a budget holds that many
    assert s.whole_tier_bytes == 4 * N_EXPERT * f32_expert > s.expert_bytes
    assert fit.holds == two_layers // f32_expert
    text = format_summary(s, [fit])
    assert "--n-cpu-moe 3" in text and "top-2" in text and "(1 dense)" in text
    assert "a device slot holds any expert" in text


def test_bad_files_are_one_clear_error(tmp_path: Path) -> None:
    good = write_moe(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut-data.gguf").write_bytes(good[: len(good) - 100])
    with pytest.raises(ModelFileError, match="truncated: its tensors need"):
        read_header(tmp_path / "cut-data.gguf")
    (tmp_path / "cut-header.gguf").write_bytes(good[:200])
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        read_header(tmp_path / "cut-header.gguf")
    (tmp_path / "text.gguf").write_text("not a model at all, just some text")
    with pytest.raises(ModelFileError, match="not a GGUF model"):
        read_header(tmp_path / "text.gguf")
    with pytest.raises(ModelFileError, match="does not exist"):
        read_header(tmp_path / "missing.gguf")


def test_a_dense_model_has_nothing_to_offload(tmp_path: Path) -> None:
    path = write_moe(tmp_path / "d.gguf", n_layers=2, dense_first=2)
    s = inspect_model(path)
    assert not s.is_moe and s.expert_bytes == 0
    assert "nothing to offload" in format_summary(s, [])
