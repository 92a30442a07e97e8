"""The synthetic-model writer, checked by reading its files back (no native code).

Models here use a small vocabulary written by the test itself, so they are a
few MB and the tests need neither the native build nor upstream's vocab files.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_reader import ReaderField, ReaderTensor

from pyspice.build_info import BuildNotFoundError
from pyspice.models import synth

N_VOCAB = 300
TINY_SHAPES = ("tiny", "tiny-odd")


def _tokens() -> list[bytes]:
    special = [b"<unk>", b"<s>", b"</s>"]
    byte_tokens = [f"<0x{i:02X}>".encode() for i in range(256)]
    words = ["\u2581the", "\u2581h\u00e9llo", "\u2581\u4e16\u754c", "\u2581MoE"]
    # one token that is not valid UTF-8: the copy must move raw bytes, not decode them
    odd = [b"\xff\xfe-raw"]
    rest = [f"\u2581w{i}".encode() for i in range(N_VOCAB - 3 - 256 - len(words) - 1)]
    return [*special, *byte_tokens, *(w.encode() for w in words), *odd, *rest]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vocabulary-only GGUF shaped like upstream's ggml-vocab-llama-spm.gguf."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    tokens = _tokens()
    assert len(tokens) == N_VOCAB
    writer = GGUFWriter(path, "llama")
    writer.add_string("general.name", "test-spm")
    writer.add_uint32("llama.vocab_size", N_VOCAB)  # not tokenizer.*: must not be copied
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    scores = [-float(i) / 7.0 for i in range(N_VOCAB)]
    writer.add_key_value("tokenizer.ggml.scores", scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    types = [3, 3, 3, *([6] * 256), *([1] * (N_VOCAB - 259))]
    writer.add_key_value("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, vocab: Path) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        (arch, shape): synth.synthesize(arch, shape, root / f"{arch}-{shape}.gguf", vocab=vocab)
        for arch in synth.ARCHS
        for shape in TINY_SHAPES
    }


def _kv(reader: GGUFReader) -> dict[str, Any]:
    """Model metadata; tokenizer.* is compared raw elsewhere (a token may not be UTF-8)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", "tokenizer."))}


def _tensors(reader: GGUFReader) -> dict[str, ReaderTensor]:
    return {t.name: t for t in reader.tensors}


def _ne(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _raw(field: ReaderField) -> list[bytes]:
    return [bytes(part) for part in field.parts]


def _expected_ne(arch: str, s: synth.SynthShape) -> dict[str, tuple[int, ...]]:
    """Tensor name -> GGUF ne, written out from llama.cpp's create_tensor calls for the arch."""
    e, v, x, f = s.n_embd, N_VOCAB, s.n_expert, s.n_ff_exp
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (e, v),
        "output_norm.weight": (e,),
        "output.weight": (e, v),
    }
    for i in range(s.n_layer):
        p = f"blk.{i}"
        out |= {f"{p}.attn_norm.weight": (e,), f"{p}.ffn_norm.weight": (e,)}
        moe = {
            f"{p}.ffn_gate_inp.weight": (e, x),
            f"{p}.ffn_gate_exps.weight": (e, f, x),
            f"{p}.ffn_up_exps.weight": (e, f, x),
            f"{p}.ffn_down_exps.weight": (f, e, x),
        }
        if arch == "qwen2moe":
            kv = s.n_head_kv * (e // s.n_head)
            out |= moe | {
                f"{p}.attn_q.weight": (e, e),
                f"{p}.attn_q.bias": (e,),
                f"{p}.attn_k.weight": (e, kv),
                f"{p}.attn_k.bias": (kv,),
                f"{p}.attn_v.weight": (e, kv),
                f"{p}.attn_v.bias": (kv,),
                f"{p}.attn_output.weight": (e, e),
                f"{p}.ffn_gate_inp_shexp.weight": (e,),
                f"{p}.ffn_gate_shexp.weight": (e, s.n_ff_shexp),
                f"{p}.ffn_up_shexp.weight": (e, s.n_ff_shexp),
                f"{p}.ffn_down_shexp.weight": (s.n_ff_shexp, e),
            }
            continue
        r, h = s.kv_lora_rank, s.n_head
        out |= {
            f"{p}.attn_q.weight": (e, h * (s.qk_nope_dim + s.qk_rope_dim)),
            f"{p}.attn_kv_a_mqa.weight": (e, r + s.qk_rope_dim),
            f"{p}.attn_kv_a_norm.weight": (r,),
            f"{p}.attn_k_b.weight": (s.qk_nope_dim, r, h),
            f"{p}.attn_v_b.weight": (r, s.v_head_dim, h),
            f"{p}.attn_output.weight": (h * s.v_head_dim, e),
        }
        if i < s.n_dense_lead:
            out |= {f"{p}.ffn_gate.weight": (e, s.n_ff), f"{p}.ffn_up.weight": (e, s.n_ff)}
            out |= {f"{p}.ffn_down.weight": (s.n_ff, e)}
        else:
            w = s.n_expert_shared * f
            out |= moe | {
                f"{p}.ffn_gate_shexp.weight": (e, w),
                f"{p}.ffn_up_shexp.weight": (e, w),
                f"{p}.ffn_down_shexp.weight": (w, e),
            }
    return out


def test_shape_table() -> None:
    assert set(synth.SHAPES) == {"tiny", "tiny-odd", "qwen2-57b-a14b", "deepseek-v2-lite"}
    tiny, odd = synth.SHAPES["tiny"], synth.SHAPES["tiny-odd"]
    for width in (tiny.n_embd, tiny.n_ff_exp, tiny.n_ff_shexp, tiny.n_ff, tiny.kv_lora_rank):
        assert width % 256 == 0  # K-quants apply everywhere that matters
    assert odd.n_ff_exp % 256 != 0 and odd.n_ff_exp % 32 == 0  # falls back, as 1408 does
    assert (odd.n_expert_shared * odd.n_ff_exp) % 256 == 0  # as 2 x 1408 = 2816 is
    assert (tiny.n_expert, tiny.n_expert_used, tiny.n_layer, tiny.n_ctx) == (8, 2, 4, 512)
    q = synth.SHAPES["qwen2-57b-a14b"]
    assert (q.n_embd, q.n_layer, q.n_head, q.n_head_kv) == (3584, 28, 28, 4)
    assert (q.n_expert, q.n_expert_used, q.n_ff_exp, q.n_ff_shexp) == (64, 8, 2560, 20480)
    d = synth.SHAPES["deepseek-v2-lite"]
    assert (d.n_embd, d.n_layer, d.n_head, d.n_dense_lead, d.n_ff) == (2048, 27, 16, 1, 10944)
    assert (d.n_expert, d.n_expert_used, d.n_ff_exp, d.n_expert_shared) == (64, 6, 1408, 2)
    assert (d.kv_lora_rank, d.qk_rope_dim, d.qk_nope_dim, d.v_head_dim) == (512, 64, 128, 128)


@pytest.mark.parametrize("shape", TINY_SHAPES)
@pytest.mark.parametrize("arch", synth.ARCHS)
def test_tensors_match_llama_cpp_layout(models: dict[tuple[str, str], Path], arch: str, shape: str) -> None:
    reader = GGUFReader(models[arch, shape])
    tensors = _tensors(reader)
    expected = _expected_ne(arch, synth.SHAPES[shape])
    assert set(tensors) == set(expected)  # llama.cpp refuses files with unused tensors
    assert {name: _ne(t) for name, t in tensors.items()} == expected
    assert {t.tensor_type for t in tensors.values()} == {GGMLQuantizationType.F32}


@pytest.mark.parametrize("shape", TINY_SHAPES)
@pytest.mark.parametrize("arch", synth.ARCHS)
def test_metadata(models: dict[tuple[str, str], Path], arch: str, shape: str) -> None:
    kv = _kv(GGUFReader(models[arch, shape]))
    s = synth.SHAPES[shape]
    common = {
        "general.architecture": arch,
        "general.name": f"pyspice-synth-{arch}-{shape}",
        "general.file_type": 0,
        "pyspice.synth.shape": shape,
        "pyspice.synth.seed": 0,
        f"{arch}.vocab_size": N_VOCAB,
        f"{arch}.context_length": s.n_ctx,
        f"{arch}.embedding_length": s.n_embd,
        f"{arch}.block_count": s.n_layer,
        f"{arch}.attention.head_count": s.n_head,
        f"{arch}.expert_count": 8,
        f"{arch}.expert_used_count": 2,
        f"{arch}.expert_feed_forward_length": s.n_ff_exp,
    }
    assert {k: kv[k] for k in common} == common
    assert kv[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    if arch == "qwen2moe":
        assert kv["qwen2moe.attention.head_count_kv"] == 2
        assert kv["qwen2moe.expert_shared_feed_forward_length"] == 512
        assert kv["qwen2moe.rope.freq_base"] == 1e6
        return
    mla = {
        "deepseek2.attention.head_count_kv": 1,
        "deepseek2.attention.key_length": 576,
        "deepseek2.attention.value_length": 512,
        "deepseek2.attention.key_length_mla": 192,
        "deepseek2.attention.value_length_mla": 128,
        "deepseek2.attention.q_lora_rank": 0,
        "deepseek2.attention.kv_lora_rank": 512,
        "deepseek2.rope.dimension_count": 64,
        "deepseek2.leading_dense_block_count": 1,
        "deepseek2.expert_shared_count": 2,
        "deepseek2.expert_weights_scale": 1.0,
        "deepseek2.expert_gating_func": 1,
        "deepseek2.feed_forward_length": s.n_ff,
    }
    assert {k: kv[k] for k in mla} == mla


def test_tokenizer_copied_faithfully(models: dict[tuple[str, str], Path], vocab: Path) -> None:
    source = GGUFReader(vocab).fields
    copied = GGUFReader(models["deepseek2", "tiny"]).fields
    source_keys = sorted(k for k in source if k.startswith("tokenizer."))
    assert sorted(k for k in copied if k.startswith("tokenizer.")) == source_keys
    for key in source_keys:
        assert copied[key].types == source[key].types, key
        assert _raw(copied[key])[1:] == _raw(source[key])[1:], key  # parts[0] is the key's own length
    assert "llama.vocab_size" not in copied


def test_values_are_sane(models: dict[tuple[str, str], Path]) -> None:
    tensors = _tensors(GGUFReader(models["qwen2moe", "tiny"]))
    for name, t in tensors.items():
        data = np.asarray(t.data, dtype=np.float64)
        assert np.isfinite(data).all(), name
        if name.endswith("norm.weight"):
            assert abs(data.mean() - 1.0) < 0.01 and data.std() < 0.05, name
        elif name.endswith(".bias"):
            assert 0.05 < data.std() < 0.2, name
        elif name == "token_embd.weight":
            assert data.std() == pytest.approx(1.0, rel=0.05)
        else:
            gain = 4.0 if name.endswith("ffn_gate_inp.weight") else 1.0
            assert data.std() == pytest.approx(gain / math.sqrt(_ne(t)[0]), rel=0.1), name
    gate = np.asarray(tensors["blk.0.ffn_gate_inp_shexp.weight"].data)
    assert np.count_nonzero(gate) == gate.size


def test_same_seed_same_bytes(tmp_path: Path, vocab: Path, models: dict[tuple[str, str], Path]) -> None:
    again = synth.synthesize("qwen2moe", "tiny", tmp_path / "again.gguf", vocab=vocab)
    assert again.read_bytes() == models["qwen2moe", "tiny"].read_bytes()
    other = synth.synthesize("qwen2moe", "tiny", tmp_path / "other.gguf", vocab=vocab, seed=1)
    assert other.read_bytes() != again.read_bytes()
    assert _kv(GGUFReader(other))["pyspice.synth.seed"] == 1


def test_quantizing_temporary_holds_experts_in_f16(
    tmp_path: Path, vocab: Path, models: dict[tuple[str, str], Path]
) -> None:
    """What llama-quantize reads: the routed experts F16 (half the bytes of the bulk of a
    real shape), the same values as the F32 file rounded; everything else unchanged F32."""
    tokenizer, n_vocab = synth.load_vocab(synth.shape_for("deepseek2", "tiny"), vocab)
    dims = synth.shape_for("deepseek2", "tiny")
    tmp = tmp_path / "half.gguf"
    synth._write_floats(tmp, "deepseek2", dims, 0, tokenizer, n_vocab, False, experts_f16=True)
    half = _tensors(GGUFReader(tmp))
    full = _tensors(GGUFReader(models["deepseek2", "tiny"]))
    assert half.keys() == full.keys()
    experts = [name for name in half if "_exps." in name]
    assert experts
    for name, t in half.items():
        if name in experts:
            assert t.tensor_type == GGMLQuantizationType.F16, name
            assert np.array_equal(t.data, full[name].data.astype(np.float16)), name
        else:
            assert t.tensor_type == GGMLQuantizationType.F32, name
            assert np.array_equal(t.data, full[name].data), name


def test_layers_gives_a_prefix_of_the_full_model(
    tmp_path: Path, vocab: Path, models: dict[tuple[str, str], Path]
) -> None:
    short = GGUFReader(synth.synthesize("deepseek2", "tiny", tmp_path / "short.gguf", vocab=vocab, layers=2))
    assert _kv(short)["deepseek2.block_count"] == 2
    assert _kv(short)["deepseek2.leading_dense_block_count"] == 1
    full = _tensors(GGUFReader(models["deepseek2", "tiny"]))
    short_tensors = _tensors(short)
    assert not any(name.startswith("blk.2.") for name in short_tensors)
    for name, t in short_tensors.items():
        assert np.array_equal(t.data, full[name].data), name


def test_output_directory_created_and_no_temp_left(tmp_path: Path, vocab: Path) -> None:
    out = tmp_path / "a" / "b" / "m.gguf"
    assert synth.synthesize("qwen2moe", "tiny", out, vocab=vocab, layers=1) == out
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]


# The published configurations (config.json of Qwen/Qwen2-57B-A14B and
# deepseek-ai/DeepSeek-V2-Lite), in the GGUF keys llama.cpp reads them from.
PUBLISHED_KV: dict[str, dict[str, Any]] = {
    "qwen2-57b-a14b": {
        "qwen2moe.vocab_size": 151936,
        "qwen2moe.embedding_length": 3584,
        "qwen2moe.block_count": 28,
        "qwen2moe.attention.head_count": 28,
        "qwen2moe.attention.head_count_kv": 4,
        "qwen2moe.expert_count": 64,
        "qwen2moe.expert_used_count": 8,
        "qwen2moe.expert_feed_forward_length": 2560,
        "qwen2moe.expert_shared_feed_forward_length": 20480,
        "qwen2moe.feed_forward_length": 18944,
        "qwen2moe.rope.freq_base": 1_000_000.0,
    },
    "deepseek-v2-lite": {
        "deepseek2.vocab_size": 102400,
        "deepseek2.embedding_length": 2048,
        "deepseek2.block_count": 27,
        "deepseek2.leading_dense_block_count": 1,
        "deepseek2.feed_forward_length": 10944,
        "deepseek2.attention.head_count": 16,
        "deepseek2.expert_count": 64,
        "deepseek2.expert_used_count": 6,
        "deepseek2.expert_feed_forward_length": 1408,
        "deepseek2.expert_shared_count": 2,
        "deepseek2.attention.q_lora_rank": 0,  # no query compression: a plain attn_q
        "deepseek2.attention.kv_lora_rank": 512,
        "deepseek2.rope.dimension_count": 64,
        "deepseek2.attention.key_length_mla": 128 + 64,  # qk_nope_head_dim + qk_rope_head_dim
        "deepseek2.attention.value_length_mla": 128,
        "deepseek2.expert_gating_func": 1,  # softmax scoring
        "deepseek2.expert_weights_scale": 1.0,  # routed_scaling_factor
        "deepseek2.expert_weights_norm": False,  # norm_topk_prob
        "deepseek2.rope.freq_base": 10_000.0,
    },
}
# Total parameters as the model cards give them (57.4B; 15.7B), to 0.5%.
PUBLISHED_PARAMS = {"qwen2-57b-a14b": 57.4e9, "deepseek-v2-lite": 15.7e9}
REAL_SHAPES = {"qwen2-57b-a14b": "qwen2moe", "deepseek-v2-lite": "deepseek2"}


def _plan(shape: str) -> tuple[synth.SynthShape, dict[str, tuple[int, ...]]]:
    """The full-depth shape and its tensors' numpy shapes: metadata only, nothing is written."""
    arch = REAL_SHAPES[shape]
    dims = synth.shape_for(arch, shape)
    assert dims.n_vocab is not None
    return dims, {t.name: t.shape for t in synth.tensor_plan(arch, dims, dims.n_vocab)}


@pytest.mark.parametrize("shape", sorted(REAL_SHAPES))
def test_real_shape_metadata_is_the_published_config(shape: str) -> None:
    arch = REAL_SHAPES[shape]
    dims = synth.SHAPES[shape]
    assert dims.archs == (arch,) and dims.n_vocab is not None
    kv = {kv.key: kv.value for kv in synth._model_kv(arch, dims, dims.n_vocab, seed=0)}
    assert {k: kv[k] for k in PUBLISHED_KV[shape]} == PUBLISHED_KV[shape]
    _, plan = _plan(shape)
    assert sum(math.prod(s) for s in plan.values()) == pytest.approx(PUBLISHED_PARAMS[shape], rel=0.005)


def test_qwen2_57b_a14b_tensors() -> None:
    dims, plan = _plan("qwen2-57b-a14b")
    assert (dims.vocab, dims.n_vocab) == ("qwen2", 151936)
    assert plan["token_embd.weight"] == plan["output.weight"] == (151936, 3584)
    kv_width = 4 * 3584 // 28  # 4 KV heads of head size 128
    for i in range(28):
        p = f"blk.{i}"
        assert plan[f"{p}.attn_q.weight"] == (3584, 3584)
        assert plan[f"{p}.attn_k.weight"] == plan[f"{p}.attn_v.weight"] == (kv_width, 3584)
        assert plan[f"{p}.ffn_gate_inp.weight"] == (64, 3584)
        assert plan[f"{p}.ffn_gate_exps.weight"] == plan[f"{p}.ffn_up_exps.weight"] == (64, 2560, 3584)
        assert plan[f"{p}.ffn_down_exps.weight"] == (64, 3584, 2560)
        assert plan[f"{p}.ffn_gate_shexp.weight"] == plan[f"{p}.ffn_up_shexp.weight"] == (20480, 3584)
        assert plan[f"{p}.ffn_down_shexp.weight"] == (3584, 20480)
    assert not any(name.startswith("blk.28.") for name in plan)
    # "A14B": every tensor with 8 of 64 experts' weights, embeddings included
    exps = sum(math.prod(s) for name, s in plan.items() if "_exps" in name)
    active = sum(math.prod(s) for s in plan.values()) - exps * (1 - 8 / 64)
    assert 13.5e9 < active < 14.5e9


def test_deepseek_v2_lite_tensors() -> None:
    dims, plan = _plan("deepseek-v2-lite")
    assert (dims.vocab, dims.n_vocab) == ("deepseek-llm", 102400)
    assert plan["token_embd.weight"] == plan["output.weight"] == (102400, 2048)
    assert plan["blk.0.ffn_gate.weight"] == plan["blk.0.ffn_up.weight"] == (10944, 2048)
    assert plan["blk.0.ffn_down.weight"] == (2048, 10944)
    assert not any(name.startswith("blk.0.") and "_exps" in name for name in plan)
    for i in range(27):
        p = f"blk.{i}"
        assert plan[f"{p}.attn_q.weight"] == (16 * (128 + 64), 2048)  # no q_a / q_b: no q compression
        assert plan[f"{p}.attn_kv_a_mqa.weight"] == (512 + 64, 2048)  # latent + shared rope key
        assert plan[f"{p}.attn_kv_a_norm.weight"] == (512,)
        assert plan[f"{p}.attn_k_b.weight"] == (16, 512, 128)
        assert plan[f"{p}.attn_v_b.weight"] == (16, 128, 512)
        assert plan[f"{p}.attn_output.weight"] == (2048, 16 * 128)
        if i == 0:
            continue
        assert plan[f"{p}.ffn_gate_inp.weight"] == (64, 2048)
        assert plan[f"{p}.ffn_gate_exps.weight"] == plan[f"{p}.ffn_up_exps.weight"] == (64, 1408, 2048)
        assert plan[f"{p}.ffn_down_exps.weight"] == (64, 2048, 1408)
        assert plan[f"{p}.ffn_gate_shexp.weight"] == (2 * 1408, 2048)  # 2 shared experts, fused
        assert plan[f"{p}.ffn_down_shexp.weight"] == (2048, 2 * 1408)
        assert f"{p}.ffn_gate.weight" not in plan
    assert not any(name.startswith("blk.27.") for name in plan)
    assert not any("attn_q_a" in name or "attn_q_b" in name or "attn_kv_b" in name for name in plan)
    # "2.4B activated": 6 of 64 experts, the output head but not the embedding lookup
    exps = sum(math.prod(s) for name, s in plan.items() if "_exps" in name)
    active = sum(math.prod(s) for s in plan.values()) - exps * (1 - 6 / 64) - 102400 * 2048
    assert active == pytest.approx(2.4e9, rel=0.03)


def test_tiny_shapes_keep_llama_spm() -> None:
    for name in ("tiny", "tiny-odd"):
        assert (synth.SHAPES[name].vocab, synth.SHAPES[name].n_vocab) == ("llama-spm", None)


def test_real_shape_plans() -> None:
    q = synth.tensor_plan("qwen2moe", synth.shape_for("qwen2moe", "qwen2-57b-a14b", layers=1), 32000)
    qshapes = {t.name: t.shape for t in q}
    assert qshapes["blk.0.ffn_gate_exps.weight"] == (64, 2560, 3584)
    assert qshapes["blk.0.ffn_down_exps.weight"] == (64, 3584, 2560)
    assert qshapes["blk.0.ffn_down_shexp.weight"] == (3584, 20480)
    assert qshapes["blk.0.attn_k.weight"] == (512, 3584)
    assert not any(name.startswith("blk.1.") for name in qshapes)
    d = synth.tensor_plan("deepseek2", synth.shape_for("deepseek2", "deepseek-v2-lite", layers=2), 32000)
    dshapes = {t.name: t.shape for t in d}
    assert dshapes["blk.0.ffn_down.weight"] == (2048, 10944)
    assert dshapes["blk.1.ffn_up_exps.weight"] == (64, 1408, 2048)
    assert dshapes["blk.1.ffn_gate_shexp.weight"] == (2816, 2048)
    assert dshapes["blk.1.attn_q.weight"] == (16 * 192, 2048)
    assert dshapes["blk.1.attn_k_b.weight"] == (16, 512, 128)
    expert_bytes = sum(t.nbytes for t in d if "_exps" in t.name)
    assert expert_bytes == 3 * 64 * 1408 * 2048 * 4


def test_quant_names() -> None:
    assert synth.quant_spec(None) is None
    assert synth.quant_spec("f32") is None
    assert synth.quant_spec("q4_k") == synth.QuantSpec("Q4_K", pure=True)
    assert synth.quant_spec("Q8_0") == synth.QuantSpec("Q8_0", pure=True)
    assert synth.quant_spec("Q5_K_M") == synth.QuantSpec("Q5_K_M", pure=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "llama"}, "unknown arch"),
        ({"shape": "huge"}, "unknown shape"),
        ({"arch": "deepseek2", "shape": "qwen2-57b-a14b"}, "defined for qwen2moe"),
        ({"arch": "qwen2moe", "shape": "deepseek-v2-lite"}, "defined for deepseek2"),
        ({"quant": "Q4_7"}, "unknown quant"),
        ({"layers": 0}, "at least 1"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_arguments(tmp_path: Path, vocab: Path, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"arch": "qwen2moe", "shape": "tiny", "vocab": vocab} | kwargs
    out = tmp_path / "sub" / "m.gguf"
    with pytest.raises(ValueError, match=message):
        synth.synthesize(out=out, **args)
    assert not out.parent.exists()


def test_quant_without_build_fails_before_writing(
    tmp_path: Path, vocab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_build() -> Any:
        raise BuildNotFoundError("no build here")

    monkeypatch.setattr(synth, "load_build_info", no_build)
    with pytest.raises(BuildNotFoundError):
        synth.synthesize("qwen2moe", "tiny", tmp_path / "m.gguf", vocab=vocab, quant="Q8_0")
    assert list(tmp_path.iterdir()) == []


def test_tensor_types_agree_with_gguf_reader(models: dict[tuple[str, str], Path]) -> None:
    path = models["deepseek2", "tiny-odd"]
    assert synth.tensor_types(path) == {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def _by_key(kvs: list[Any]) -> dict[str, Any]:
    return {kv.key: kv.value for kv in kvs}


def test_pad_vocab(vocab: Path) -> None:
    tokenizer, n_tokens = synth.read_vocab(vocab)
    assert synth.pad_vocab(tokenizer, n_tokens) == tokenizer
    padded = synth.pad_vocab(tokenizer, N_VOCAB + 20)
    assert [kv.key for kv in padded] == [kv.key for kv in tokenizer]
    before, after = _by_key(tokenizer), _by_key(padded)
    tokens = after["tokenizer.ggml.tokens"]
    assert tokens[:N_VOCAB] == before["tokenizer.ggml.tokens"]  # no id moves
    assert tokens[N_VOCAB:] == [f"[PAD{i}]".encode() for i in range(N_VOCAB, N_VOCAB + 20)]
    assert after["tokenizer.ggml.token_type"][N_VOCAB:] == [5] * 20  # LLAMA_TOKEN_TYPE_UNUSED
    assert after["tokenizer.ggml.scores"][:N_VOCAB] == before["tokenizer.ggml.scores"]
    assert after["tokenizer.ggml.scores"][N_VOCAB:] == [-1000.0] * 20
    per_token = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    rest = {k: v for k, v in before.items() if k not in per_token}
    assert {k: after[k] for k in rest} == rest
    with pytest.raises(ValueError, match="cannot pad a 300-token vocabulary down to 299"):
        synth.pad_vocab(tokenizer, N_VOCAB - 1)


def test_pad_vocab_refuses_inconsistent_arrays(vocab: Path) -> None:
    tokenizer, _ = synth.read_vocab(vocab)
    short = [
        replace(kv, value=kv.value[:-1]) if kv.key == "tokenizer.ggml.token_type" else kv for kv in tokenizer
    ]
    with pytest.raises(ValueError, match="token_type has 299 entries for 300 tokens"):
        synth.pad_vocab(short, N_VOCAB + 1)
    clash = [
        replace(kv, value=[*kv.value[:-1], f"[PAD{N_VOCAB}]".encode()])
        if kv.key == "tokenizer.ggml.tokens"
        else kv
        for kv in tokenizer
    ]
    with pytest.raises(ValueError, match="already has"):
        synth.pad_vocab(clash, N_VOCAB + 1)


def test_shape_n_vocab_pads_the_model(tmp_path: Path, vocab: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    padded = replace(synth.SHAPES["tiny"], name="tiny-padded", n_vocab=N_VOCAB + 20)
    monkeypatch.setitem(synth.SHAPES, "tiny-padded", padded)
    out = synth.synthesize("qwen2moe", "tiny-padded", tmp_path / "m.gguf", vocab=vocab, layers=1)
    reader = GGUFReader(out)
    assert _kv(reader)["qwen2moe.vocab_size"] == N_VOCAB + 20
    tensors = _tensors(reader)
    assert _ne(tensors["token_embd.weight"]) == _ne(tensors["output.weight"]) == (256, N_VOCAB + 20)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == N_VOCAB + 20
    assert bytes(tokens.parts[tokens.data[-1]]) == f"[PAD{N_VOCAB + 19}]".encode()
    monkeypatch.setitem(synth.SHAPES, "tiny-short", replace(padded, name="tiny-short", n_vocab=N_VOCAB - 1))
    with pytest.raises(ValueError, match="shape 'tiny-short': cannot pad"):
        synth.synthesize("qwen2moe", "tiny-short", tmp_path / "short.gguf", vocab=vocab)
    assert not (tmp_path / "short.gguf").exists()


def test_shape_names_its_upstream_vocab(vocab: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    class FakeBuild:
        def vocab(self, name: str) -> Path:
            asked.append(name)
            return vocab

    monkeypatch.setattr(synth, "load_build_info", FakeBuild)
    for shape in ("tiny", "qwen2-57b-a14b", "deepseek-v2-lite"):
        dims = synth.SHAPES[shape]
        _, n_vocab = synth.load_vocab(dims)
        assert n_vocab == (dims.n_vocab or N_VOCAB)  # the stand-in file is padded to the published size
    assert asked == ["llama-spm", "qwen2", "deepseek-llm"]


def test_vocab_must_be_a_gguf_with_tokens(tmp_path: Path, vocab: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(vocab.read_bytes()[:5000])
    with pytest.raises(ValueError, match="cannot read GGUF metadata"):
        synth.read_vocab(truncated)
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        synth.read_vocab(not_gguf)
    _, n_vocab = synth.read_vocab(vocab)
    assert n_vocab == N_VOCAB
