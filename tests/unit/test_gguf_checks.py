"""The header rules of formats.gguf_checks that the differential fuzz harness
(fuzz/fuzz_gguf_differential.py) found missing: each case is a header read_header
accepted before its rule existed and the pinned llama.cpp then died on (the assert is in
the case's id), now refused with one ModelFileError naming the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from pyspice.formats.model_info import ModelFileError, read_header

ROOT = Path(__file__).resolve().parents[2]
U32, I32, F32, STR, ARR = (
    gguf.GGUFValueType.UINT32,
    gguf.GGUFValueType.INT32,
    gguf.GGUFValueType.FLOAT32,
    gguf.GGUFValueType.STRING,
    gguf.GGUFValueType.ARRAY,
)
N_EMBD, N_FF, N_EXPERT, N_LAYER = 32, 16, 4, 3
Q = gguf.GGMLQuantizationType


def _kv(arch: str) -> dict[str, tuple[Any, ...]]:
    kv: dict[str, tuple[Any, ...]] = {
        f"{arch}.block_count": (N_LAYER, U32),
        f"{arch}.embedding_length": (N_EMBD, U32),
        f"{arch}.attention.head_count": (2, U32),
        f"{arch}.attention.head_count_kv": (1, U32),
        f"{arch}.attention.layer_norm_rms_epsilon": (1e-6, F32),
        f"{arch}.expert_count": (N_EXPERT, U32),
        f"{arch}.expert_used_count": (2, U32),
    }
    if arch == "deepseek2":  # MLA as synth writes it: latent 16, RoPE 8, nope 8, v 8
        kv.update({
            f"{arch}.attention.key_length": (24, U32),
            f"{arch}.attention.value_length": (16, U32),
            f"{arch}.attention.key_length_mla": (16, U32),
            f"{arch}.attention.value_length_mla": (8, U32),
            f"{arch}.attention.kv_lora_rank": (16, U32),
            f"{arch}.rope.dimension_count": (8, U32),
            f"{arch}.expert_gating_func": (1, U32),
        })  # fmt: skip
    return kv


def write_model(
    path: Path,
    arch: str = "deepseek2",
    set_kv: dict[str, tuple[Any, ...]] | None = None,
    drop: tuple[str, ...] = (),
    types: dict[str, Q] | None = None,
    alignment: int | None = None,
    experts: bool = True,
) -> Path:
    """A small MoE header with real tensor data (layer 0 dense, the rest MoE); `set_kv`
    adds or replaces fields ((value, type) or (list, ARRAY, item type)), `drop` removes
    them, `types` stores named tensors in another ggml type; `experts=False` leaves the
    expert tensors out."""
    w = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        w.data_alignment = alignment
        w.add_uint32("general.alignment", alignment)
    kv = {**_kv(arch), **(set_kv or {})}
    for key, spec in kv.items():
        if key not in drop:
            w.add_key_value(key, spec[0], spec[1], sub_type=spec[2] if len(spec) > 2 else None)
    types = types or {}

    def tensor(name: str, *shape: int) -> None:
        qtype = types.get(name)
        if qtype is None:
            w.add_tensor(name, np.zeros(shape, np.float32))
        elif qtype == Q.I32:
            w.add_tensor(name, np.zeros(shape, np.int32))
        else:  # raw blocks: the writer takes the byte shape
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)

    tensor("token_embd.weight", 8, N_EMBD)
    tensor("blk.0.attn_norm.weight", 3)  # 12 bytes: the next tensor starts 16 bytes on
    tensor("blk.0.ffn_up.weight", N_FF, N_EMBD)
    for il in range(1, N_LAYER if experts else 1):
        tensor(f"blk.{il}.ffn_gate_exps.weight", N_EXPERT, N_FF, N_EMBD)
        tensor(f"blk.{il}.ffn_up_exps.weight", N_EXPERT, N_FF, N_EMBD)
        tensor(f"blk.{il}.ffn_down_exps.weight", N_EXPERT, N_EMBD, N_FF)
    tensor("output_norm.weight", N_EMBD)
    tensor("output.weight", 8, N_EMBD)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["deepseek2", "qwen2moe"])
def test_the_base_model_passes(tmp_path: Path, arch: str) -> None:
    read_header(write_model(tmp_path / "m.gguf", arch))


def test_the_differential_seed_corpus_passes() -> None:
    """The fuzz seeds are complete models llama.cpp loads: no rule may refuse them."""
    seeds = sorted((ROOT / "fuzz" / "corpus" / "gguf_differential").glob("*.gguf"))
    assert len(seeds) == 3
    for seed in seeds:
        read_header(seed)


CASES = [
    # llama-model.cpp load_hparams: GGML_ASSERT(n_layer_all > 0 && n_layer_all <= LLAMA_MAX_LAYERS)
    pytest.param({"deepseek2.block_count": (0, U32)}, (), "block_count is 0", id="n_layer_all-zero"),
    pytest.param(
        {"deepseek2.block_count": (2**32 - 1, U32)}, (), "block_count is 4294967295", id="n_layer_all-max"
    ),
    # GGML_ASSERT(n_layer_nextn <= n_layer_all)
    pytest.param(
        {"deepseek2.nextn_predict_layers": (16, U32)}, (), "nextn_predict_layers is 16", id="n_layer_nextn"
    ),
    # GGML_ASSERT(n_expert_used_max > 0): expert_used_count missing reads as 0
    pytest.param(
        {}, ("deepseek2.expert_used_count",), "expert_used_count is missing", id="n_expert_used-missing"
    ),
    # GGML_ASSERT(n_expert_used_max <= n_expert): a per-layer array
    pytest.param(
        {"deepseek2.expert_used_count": ([2, 511, 2], ARR, U32)},
        (),
        r"expert_used_count is \[2, 511, 2\]",
        id="n_expert_used-per-layer",
    ),
    # GGML_ASSERT(n_expert_groups < n_expert)
    pytest.param(
        {"deepseek2.expert_group_count": (512, U32)}, (), "expert_group_count is 512", id="n_expert_groups"
    ),
    pytest.param(
        {"deepseek2.expert_group_count": (2, U32)},
        (),
        "expert_group_count is 2 .expert_group_used_count 0",
        id="n_group_used",
    ),
    # llama-graph.cpp build_moe_ffn: GGML_ABORT("fatal error") on an unknown gating function
    pytest.param(
        {"deepseek2.expert_gating_func": (1092642976, U32)},
        (),
        "expert_gating_func is 1092642976",
        id="gating_op",
    ),
    # ggml-cpu ops.cpp: GGML_ASSERT(eps >= 0.0f), at the first decode
    pytest.param(
        {"deepseek2.attention.layer_norm_rms_epsilon": (float("nan"), F32)},
        (),
        "layer_norm_rms_epsilon is nan",
        id="eps-nan",
    ),
    pytest.param(
        {"deepseek2.attention.layer_norm_rms_epsilon": (-1.0, F32)},
        (),
        "layer_norm_rms_epsilon is -1",
        id="eps-negative",
    ),
    # llama-graph.cpp llm_graph_input_attn_temp::set_input: GGML_ASSERT(n_attn_temp_floor_scale != 0)
    pytest.param(
        {"deepseek2.attention.temperature_scale": (0.5, F32)},
        (),
        "temperature_length is missing",
        id="n_attn_temp_floor_scale",
    ),
    # GGML_ASSERT(rope_scaling_type_train != LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED)
    pytest.param(
        {"deepseek2.rope.scaling.type": ("bogus", STR)}, (), "rope.scaling.type is 'bogus'", id="rope_scaling"
    ),
    # models/deepseek2.cpp: GGML_ASSERT(n_embd_head_qk_nope >= 1)
    pytest.param(
        {"deepseek2.attention.key_length_mla": (4, U32)},
        (),
        "key_length_mla 4. must be wider",
        id="n_embd_head_qk_nope",
    ),
    # ggml.c ggml_set_rows: GGML_ASSERT(a->ne[0] == b->ne[0]) (a KV cache row that is not the latent)
    pytest.param(
        {"deepseek2.attention.head_count_kv": (384, U32)},
        (),
        "caches one latent head",
        id="mla-head_count_kv",
    ),
]


@pytest.mark.parametrize(("set_kv", "drop", "message"), CASES)
def test_a_header_llama_cpp_dies_on_is_refused(
    tmp_path: Path, set_kv: dict[str, tuple[Any, ...]], drop: tuple[str, ...], message: str
) -> None:
    bad = write_model(tmp_path / "bad.gguf", set_kv=set_kv, drop=drop)
    with pytest.raises(ModelFileError, match=message) as caught:
        read_header(bad)
    assert str(bad) in str(caught.value)


def test_more_experts_than_llama_cpp_holds_is_refused(tmp_path: Path) -> None:
    """GGML_ASSERT(n_expert <= LLAMA_MAX_EXPERTS), here with no expert tensor to disagree."""
    bad = write_model(tmp_path / "bad.gguf", set_kv={"deepseek2.expert_count": (2000, U32)}, experts=False)
    with pytest.raises(ModelFileError, match=r"expert_count is 2000 \(a MoE model has 1 to 1024"):
        read_header(bad)


def test_no_expert_used_count_without_experts(tmp_path: Path) -> None:
    """GGML_ASSERT(n_expert_used_max == 0) for a model without experts."""
    bad = write_model(tmp_path / "bad.gguf", set_kv={"deepseek2.expert_count": (0, U32)})
    # its expert tensors are refused first; without them, the count alone
    with pytest.raises(ModelFileError, match="expert_count is 0"):
        read_header(bad)
    dense = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(dense, "qwen2")
    w.add_uint32("qwen2.block_count", 1)
    w.add_uint32("qwen2.expert_used_count", 2)
    w.add_tensor("token_embd.weight", np.zeros((8, N_EMBD), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="expert_used_count is 2 but the model has no experts"):
        read_header(dense)


def test_qwen2moe_rope_is_the_head_size(tmp_path: Path) -> None:
    """models/qwen2moe.cpp: GGML_ASSERT(n_embd_head == n_rot), when the context is made."""
    bad = write_model(tmp_path / "bad.gguf", "qwen2moe", set_kv={"qwen2moe.rope.dimension_count": (32, U32)})
    with pytest.raises(ModelFileError, match=r"key_length 16, value_length 16 and rope\.dimension_count 32"):
        read_header(bad)


@pytest.mark.parametrize(("qtype", "tensor"), [(Q.Q8_1, "output.weight"), (Q.I32, "output_norm.weight")])
def test_a_weight_type_llama_cpp_cannot_compute_with_is_refused(
    tmp_path: Path, qtype: Q, tensor: str
) -> None:
    """Q8_1 output: SIGSEGV in the first decode (no dot product); I32 norm: binary_op's
    GGML_ABORT("unsupported types")."""
    bad = write_model(tmp_path / "bad.gguf", types={tensor: qtype})
    with pytest.raises(ModelFileError, match=f"tensor {tensor} has type {qtype.name}"):
        read_header(bad)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_a_vector_that_is_not_f32_is_refused(tmp_path: Path, qtype: Q) -> None:
    """An F16 norm weight: binary_op's GGML_ABORT("unsupported types") at the first decode
    (found by long run 2, blk.1.attn_kv_a_norm.weight)."""
    bad = write_model(tmp_path / "bad.gguf", types={"output_norm.weight": qtype})
    with pytest.raises(ModelFileError, match=f"tensor output_norm.weight is a vector of type {qtype.name}"):
        read_header(bad)
    read_header(write_model(tmp_path / "ok.gguf", types={"output.weight": qtype}))  # a matrix may be


def test_a_tensor_off_ggmls_alignment_is_refused(tmp_path: Path) -> None:
    """general.alignment 8 is a valid GGUF, but llama.cpp maps tensors in place and asserts
    each is 32-byte aligned (ggml-backend.cpp, TENSOR_ALIGNMENT)."""
    bad = write_model(tmp_path / "bad.gguf", alignment=8)
    with pytest.raises(ModelFileError, match="not a multiple of 32"):
        read_header(bad)
    read_header(write_model(tmp_path / "wide.gguf", alignment=64))  # coarser is fine


def test_deepseek2_without_attention_heads_is_refused(tmp_path: Path) -> None:
    """With no head_count llama.cpp reads no head size (key_length 24 is ignored) and takes the
    head and its RoPE part as 0: GGML_ASSERT(n_embd_head_qk_nope >= 1) (found by the long run)."""
    drop = ("deepseek2.attention.head_count", "deepseek2.attention.value_length_mla")
    bad = write_model(tmp_path / "bad.gguf", drop=drop)
    with pytest.raises(ModelFileError, match=r"key_length 0\) must be wider .* no attention\.head_count"):
        read_header(bad)


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
@pytest.mark.parametrize("field", ["attention.head_count_kv", "expert_used_count"])
def test_per_layer_values_that_differ_are_refused(tmp_path: Path, arch: str, field: str) -> None:
    """head_count_kv [1, 2]: GGML_ASSERT(a->ne[0] == b->ne[0]) in ggml_set_rows; expert_used_count
    [2, 3]: GGML_ASSERT in ggml_view; both at the first decode (long runs 2 and 3)."""
    per_layer = {f"{arch}.{field}": ([1, 2, 1], ARR, U32)}
    bad = write_model(tmp_path / "bad.gguf", arch, set_kv=per_layer)
    message = rf"{field} is \[1, 2, 1\], but {arch} has one value for every layer"
    with pytest.raises(ModelFileError, match=message):
        read_header(bad)
    value = 1 if field.startswith("attention") else 2
    per_layer[f"{arch}.{field}"] = ([value] * 3, ARR, U32)  # per layer, but one value
    read_header(write_model(tmp_path / "ok.gguf", arch, set_kv=per_layer))


def test_mla_head_count_kv_defaults_to_head_count(tmp_path: Path) -> None:
    """Without head_count_kv llama.cpp takes head_count (2): two cache heads, not one latent."""
    bad = write_model(tmp_path / "bad.gguf", drop=("deepseek2.attention.head_count_kv",))
    with pytest.raises(ModelFileError, match=r"caches one latent head.*gives \[2\]"):
        read_header(bad)


@pytest.mark.parametrize("n_tokens", [5, 300])  # short, and longer than the reader's summaries
def test_a_vocabulary_with_a_token_twice_is_refused(tmp_path: Path, n_tokens: int) -> None:
    """llama_vocab::load: GGML_ASSERT(id_to_token.size() == token_to_id.size())."""
    tokens = [f"t{i}" for i in range(n_tokens - 1)] + ["t1"]
    good = write_model(tmp_path / "good.gguf", set_kv={"tokenizer.ggml.tokens": (tokens[:-1], ARR, STR)})
    assert read_header(good).metadata["tokenizer.ggml.tokens"] is not None
    bad = write_model(tmp_path / "bad.gguf", set_kv={"tokenizer.ggml.tokens": (tokens, ARR, STR)})
    with pytest.raises(
        ModelFileError, match=f"tokens 1 and {n_tokens - 1} of tokenizer.ggml.tokens are both b't1'"
    ):
        read_header(bad)
    # an empty token is read as "[EMPTY_<id>]": it can collide too
    clash = write_model(
        tmp_path / "clash.gguf", set_kv={"tokenizer.ggml.tokens": (["[EMPTY_1]", ""], ARR, STR)}
    )
    with pytest.raises(ModelFileError, match="tokens 0 and 1"):
        read_header(clash)


def test_long_vocabulary_arrays_are_still_summarized(tmp_path: Path) -> None:
    tokens = [f"t{i}" for i in range(300)]
    header = read_header(
        write_model(tmp_path / "m.gguf", set_kv={"tokenizer.ggml.tokens": (tokens, ARR, STR)})
    )
    assert repr(header.metadata["tokenizer.ggml.tokens"]) == "ArraySummary(item_type='string', length=300)"


def test_a_wordpiece_vocabulary_with_byte_tokens_is_refused(tmp_path: Path) -> None:
    """llama_vocab::token_to_byte: GGML_ABORT("fatal error") for WPM, reached at load."""
    vocab = {
        "tokenizer.ggml.model": ("bert", STR),
        "tokenizer.ggml.tokens": (["[UNK]", "<0x0A>", "a"], ARR, STR),
        "tokenizer.ggml.token_type": ([2, 6, 1], ARR, I32),
    }
    bad = write_model(tmp_path / "bad.gguf", set_kv=vocab)
    with pytest.raises(
        ModelFileError, match=r"bert \(WordPiece\) vocabulary has byte tokens \(token_type 6, token 1"
    ):
        read_header(bad)
    vocab["tokenizer.ggml.model"] = ("llama", STR)  # SentencePiece has them
    read_header(write_model(tmp_path / "spm.gguf", set_kv=vocab))


@pytest.mark.parametrize(
    ("set_kv", "rope"),
    [
        # ggml.c ggml_mul_mat: GGML_ASSERT(ggml_can_mul_mat(a, b)) as the context was made: head size 1
        ({"qwen2moe.attention.head_count": (32, U32), "qwen2moe.attention.head_count_kv": (16, U32)}, 1),
        # ggml-cpu ops.cpp: GGML_ASSERT(n_dims % 2 == 0)
        ({"qwen2moe.attention.key_length": (15, U32), "qwen2moe.attention.value_length": (15, U32),
          "qwen2moe.rope.dimension_count": (15, U32)}, 15),
    ],
    ids=["head-size-1", "odd-rope"],
)  # fmt: skip
def test_odd_rope_dimensions_are_refused(
    tmp_path: Path, set_kv: dict[str, tuple[Any, ...]], rope: int
) -> None:
    bad = write_model(tmp_path / "bad.gguf", "qwen2moe", set_kv=set_kv)
    with pytest.raises(ModelFileError, match=f"turns {rope} RoPE dimensions"):
        read_header(bad)


def test_deepseek2s_own_rope_dimensions_must_be_even_too(tmp_path: Path) -> None:
    bad = write_model(tmp_path / "bad.gguf", set_kv={"deepseek2.rope.dimension_count": (7, U32)})
    with pytest.raises(ModelFileError, match="turns 7 RoPE dimensions"):
        read_header(bad)


@pytest.mark.parametrize("kv", [2**30 + 1, 3, 0])
def test_kv_heads_that_do_not_divide_the_heads_are_refused(tmp_path: Path, kv: int) -> None:
    """2**30 + 1 key/value heads of 16 wrap llama.cpp's 32-bit key width to 16, pass its tensor
    checks and trip GGML_ASSERT(ggml_nelements(a) == ne0*ne1*ne2) (the differential fuzzer)."""
    bad = write_model(
        tmp_path / "bad.gguf", "qwen2moe", set_kv={"qwen2moe.attention.head_count_kv": (kv, U32)}
    )
    with pytest.raises(ModelFileError, match=f"head_count 2 and head_count_kv {kv}; head_count_kv must be"):
        read_header(bad)
