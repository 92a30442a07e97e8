"""Consistency rules for a GGUF's header, checked before llama.cpp sees the file.

llama.cpp trusts parts of a header it should not: an `expert_used_count` of 0
or above `expert_count` trips a GGML_ASSERT (SIGABRT, no message behind a
hidden log), and an expert tensor sized for another expert count loads and
runs wrong. Each rule is one function; `validate_header` runs them all, and
formats.model_info.read_header (the one entry point every command, the API
and inspect use to open a model) calls it. A rule raises ModelFileError naming
the file, the field and what a valid file holds.

The rules from check_tensor_placement on were found by the differential fuzz
harness (fuzz/fuzz_gguf_differential.py): each is a header the reader passed
and the pinned llama.cpp then died on, by a GGML_ASSERT or GGML_ABORT at load,
at context creation or at the first decode (the assert is named in each
rule's docstring). tests/unit/test_gguf_checks.py pins each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pyspice.formats.gguf_header import ArraySummary, ModelFileError, RawHeader, tensor_nbytes
from pyspice.formats.tensor_names import EXPERT_TENSOR

# GGML_MAX_DIMS in ggml.h: a tensor of more dimensions cannot be represented
MAX_DIMS = 4
# the GGUF versions the pinned llama.cpp reads (ggml/src/gguf.cpp: GGUF_VERSION 3, v1 dropped)
GGUF_VERSIONS = (2, 3)
# GGML_MAX_NAME in ggml.h: a tensor name holds at most this many bytes less one
GGML_MAX_NAME = 64
# llama.cpp's limits (src/llama-hparams.h) and ggml's (TENSOR_ALIGNMENT, ggml-impl.h)
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
TENSOR_ALIGNMENT = 32
# llama_expert_gating_func_type: none, softmax, sigmoid, softmax_weight, sqrt_softplus
GATING_FUNCS = range(5)
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# what check_vocabulary reads whole (the reader summarizes other long arrays)
VOCAB_KEYS = frozenset(("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
_TOKEN_TYPE_BYTE = 6  # llama_token_type
# ggml types no llama.cpp weight can have: the activation formats of the quantized dot
# products (no dot product of their own: a matmul on one jumps through a null pointer) and
# the integer and F64 types (the CPU kernels abort on them as a weight)
NON_WEIGHT_TYPES = {9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"}
# the architecture of pyspice's sidecars (formats.sidecar): GGUFs llama.cpp never loads
SIDECAR_ARCH = "spice-sidecar"
# architectures whose graph asserts one head size for keys, values and RoPE (in src/models/)
ROPE_IS_HEAD_SIZE = frozenset(
    (
        "llama",
        "llama4",
        "qwen2",
        "qwen2moe",
        "qwen3",
        "qwen3moe",
        "olmoe",
        "dbrx",
        "deepseek",
        "grok",
        "dots1",
    )
)


class _Tensor(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def type_id(self) -> int: ...
    @property
    def offset(self) -> int: ...


def _int_field(meta: Mapping[str, Any], key: str) -> int | None:
    """An integer metadata field; None when absent or not a plain integer (a per-layer
    array, which some architectures use, is checked per layer by llama.cpp)."""
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _int_values(meta: Mapping[str, Any], key: str) -> list[int] | None:
    """An integer field or per-layer integer array as a list; None when absent or of
    another type (llama.cpp refuses a field of the wrong type by itself, with an error)."""
    value = meta.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return [value]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return list(value)
    return None


def _arch(meta: Mapping[str, Any]) -> str:
    return str(meta.get("general.architecture", ""))


_FIX = "re-download the model, or rebuild it with `pyspice models`"


def check_container(path: Path, header: RawHeader) -> None:
    """What ggml's own GGUF reader (gguf.cpp) refuses, said before it refuses with a line
    llama-cpp-python hides: a version it does not read, an empty or repeated key, a tensor
    name empty, repeated or of GGML_MAX_NAME bytes or more, a row not a whole number of
    quant blocks (the order of the data: check_tensor_packing, after the alignment)."""
    if header.version not in GGUF_VERSIONS:
        if header.version < GGUF_VERSIONS[0]:
            fix = "it is too old: convert the model again with llama.cpp's convert_hf_to_gguf.py"
        elif header.version >= 1 << 16:
            fix = "a version that large is most likely a file of the other byte order, or not a GGUF"
        else:
            fix = "it is newer than this build's llama.cpp reads: update pyspice, or convert the model again"
        raise ModelFileError(
            f"{path}: GGUF version {header.version}, and this pyspice's llama.cpp reads versions "
            f"{GGUF_VERSIONS[0]} and {GGUF_VERSIONS[-1]}; {fix}"
        )
    seen: set[str] = set()
    for kv in header.metadata:
        if not kv.key:
            raise ModelFileError(f"{path} is corrupt: a metadata key is empty; {_FIX}")
        if kv.key in seen:
            raise ModelFileError(
                f"{path} is corrupt: metadata key {kv.key} appears twice (llama.cpp refuses that); {_FIX}"
            )
        seen.add(kv.key)
    names: set[str] = set()
    for t in header.tensors:
        if not t.name or len(t.name.encode("utf-8")) >= GGML_MAX_NAME:
            raise ModelFileError(
                f"{path} is corrupt: tensor name {t.name!r} is empty or {GGML_MAX_NAME} bytes or longer "
                f"(ggml holds at most {GGML_MAX_NAME - 1}); {_FIX}"
            )
        if t.name in names:
            raise ModelFileError(f"{path} is corrupt: tensor {t.name} appears twice in its directory; {_FIX}")
        names.add(t.name)
        try:
            qtype = GGMLQuantizationType(t.type_id)
        except ValueError:
            return  # read_header names the unknown type itself
        if not _fits_ggml_element_count(t.shape):
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} has shape {list(t.shape)}, whose dimensions "
                f"above 1 multiply past what ggml can index (2**63); {_FIX}"
            )
        block = GGML_QUANT_SIZES[qtype][0]
        if t.shape and t.shape[0] % block:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} of type {qtype.name} has rows of {t.shape[0]} values, "
                f"not a whole number of its {block}-value blocks; {_FIX}"
            )


INT64_MAX = 2**63 - 1


def _fits_ggml_element_count(shape: Sequence[int]) -> bool:
    """ggml_new_tensor's check, as it makes each tensor: the dimensions above 1 multiply
    to less than INT64_MAX. gguf.cpp's own check multiplies by a 0 and so passes
    (2**61 + 16, 0, 4), which ggml_new_tensor then aborts on (the differential fuzzer)."""
    if not shape:
        return True
    count = shape[0]
    for d in shape[1:]:
        if d > 1:
            if not INT64_MAX // d > count:
                return False
            count *= d
    return True


def check_tensor_packing(path: Path, tensors: Sequence[_Tensor], alignment: int) -> None:
    """Tensor data packed in directory order, as gguf.cpp reads it: each tensor starts where
    the one before ends, padded to the file's alignment (checked, as the types, before)."""
    expected = 0
    for t in tensors:
        if t.offset != expected:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name}'s data is at offset {t.offset} of the data section, "
                f"where the tensors before it end at {expected} (llama.cpp reads tensors packed in "
                f"directory order); {_FIX}"
            )
        nbytes = tensor_nbytes(GGMLQuantizationType(t.type_id).name, t.shape)
        expected += (nbytes + alignment - 1) // alignment * alignment


def check_dimensions(path: Path, tensors: Sequence[_Tensor]) -> None:
    """1 to GGML_MAX_DIMS dimensions. (A zero dimension is legal: a rank-0 sidecar
    stores empty surrogate tensors.)"""
    for t in tensors:
        if not 1 <= len(t.shape) <= MAX_DIMS:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} has {len(t.shape)} dimensions (a GGUF tensor has 1 to "
                f"{MAX_DIMS}); re-download or rebuild the file"
            )


def check_alignment(path: Path, tensors: Sequence[_Tensor], alignment: int) -> None:
    """general.alignment is a power of two and every tensor offset a multiple of it
    (llama.cpp refuses the file otherwise, without saying why)."""
    if alignment < 1 or alignment & (alignment - 1):
        raise ModelFileError(
            f"{path} is corrupt: general.alignment is {alignment}, not a power of two; "
            "re-download or rebuild the file"
        )
    for t in tensors:
        if t.offset % alignment:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} starts at offset {t.offset}, not a multiple of "
                f"the file's alignment {alignment}; re-download or rebuild the file"
            )


def check_tensor_placement(path: Path, tensors: Sequence[_Tensor], data_offset: int) -> None:
    """Every tensor's data starts at a multiple of ggml's TENSOR_ALIGNMENT (32) in the
    file: llama.cpp maps tensors in place, and a smaller general.alignment that leaves one
    off that boundary trips GGML_ASSERT(ptr % TENSOR_ALIGNMENT == 0) (ggml-backend.cpp)."""
    for t in tensors:
        if (data_offset + t.offset) % TENSOR_ALIGNMENT:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} starts at byte {data_offset + t.offset} of the file, "
                f"not a multiple of {TENSOR_ALIGNMENT} (llama.cpp maps tensors in place and needs that); "
                "re-download or rebuild the file"
            )


def check_tensor_types(path: Path, meta: Mapping[str, Any], tensors: Sequence[_Tensor]) -> None:
    """No weight of a type llama.cpp cannot compute with (NON_WEIGHT_TYPES): a Q8_1 output
    matrix segfaulted in the first decode, an I32 norm aborted in ggml's binary ops. (A
    sidecar, which llama.cpp never loads, stores integer tensors.)"""
    if _arch(meta) == SIDECAR_ARCH:
        return
    for t in tensors:
        name = NON_WEIGHT_TYPES.get(t.type_id)
        if name is not None:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} has type {name}, which no llama.cpp weight can have "
                f"(it cannot compute with it); {_FIX}"
            )


def check_vector_types(path: Path, meta: Mapping[str, Any], tensors: Sequence[_Tensor]) -> None:
    """Vectors (norm weights, biases: one dimension, or trailing ones) are F32, as every
    converter writes them and llama-quantize leaves them: the graph multiplies and adds F32
    activations by them, which the CPU kernels do only for F32 (an F16 attn_kv_a_norm aborted
    the first decode in binary_op, "unsupported types"). Sidecars are exempt."""
    if _arch(meta) == SIDECAR_ARCH:
        return
    for t in tensors:
        if t.type_id != 0 and t.shape and all(d == 1 for d in t.shape[1:]):
            name = NON_WEIGHT_TYPES.get(t.type_id) or _type_name(t.type_id)
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} is a vector of type {name}; llama.cpp computes with "
                f"F32 vectors only (norms and biases stay F32 when a model is quantized); {_FIX}"
            )


def _type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return str(type_id)


def check_block_count(path: Path, meta: Mapping[str, Any]) -> None:
    """1 <= block_count <= LLAMA_MAX_LAYERS, and nextn_predict_layers (the MTP layers, counted
    in block_count) at most block_count: GGML_ASSERTs in llama_model::load_hparams."""
    arch = _arch(meta)
    n_layer = _int_field(meta, f"{arch}.block_count")
    if n_layer is not None and not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        raise ModelFileError(
            f"{path} is corrupt: {arch}.block_count is {n_layer} but a model has 1 to {LLAMA_MAX_LAYERS} "
            f"layers; {_FIX}"
        )
    nextn = _int_field(meta, f"{arch}.nextn_predict_layers")
    if nextn is not None and n_layer is not None and not 0 <= nextn <= n_layer:
        raise ModelFileError(
            f"{path} is corrupt: {arch}.nextn_predict_layers is {nextn} but the model has {n_layer} layers "
            f"(block_count counts them); {_FIX}"
        )


def check_moe_metadata(path: Path, meta: Mapping[str, Any], tensors: Sequence[_Tensor]) -> None:
    """A MoE model's expert counts agree with each other and with its expert tensors:
    1 <= expert_count <= LLAMA_MAX_EXPERTS; expert_used_count (one value, or one per layer)
    present, each value at most expert_count and the largest at least 1; every ffn_*_exps
    tensor holds expert_count experts (its last ggml dimension). A model with no experts
    routes to none: its expert_used_count is absent or 0 (llama.cpp asserts all of it)."""
    arch = _arch(meta)
    experts = [t for t in tensors if EXPERT_TENSOR.match(t.name)]
    n_expert = _int_field(meta, f"{arch}.expert_count")
    used = _int_values(meta, f"{arch}.expert_used_count")
    shown = meta.get(f"{arch}.expert_used_count", "missing")
    if not experts and not n_expert:
        if used is not None and any(used):
            raise ModelFileError(
                f"{path} is corrupt: {arch}.expert_used_count is {shown} but the model has no experts "
                f"({arch}.expert_count is {meta.get(f'{arch}.expert_count', 'missing')}); {_FIX}"
            )
        return  # a dense model: nothing else to check
    if n_expert is None or not 1 <= n_expert <= LLAMA_MAX_EXPERTS:
        has = "it has expert tensors but " if experts else ""
        raise ModelFileError(
            f"{path} is corrupt: {has}{arch}.expert_count is {meta.get(f'{arch}.expert_count', 'missing')} "
            f"(a MoE model has 1 to {LLAMA_MAX_EXPERTS} experts per layer); {_FIX}"
        )
    if isinstance(meta.get(f"{arch}.expert_used_count"), ArraySummary):
        pass  # a per-layer array too long to have been decoded: llama.cpp checks it against expert_count
    elif used is None or not all(0 <= v <= n_expert for v in used) or max(used) < 1:
        raise ModelFileError(
            f"{path} is corrupt: {arch}.expert_used_count is {shown} but a model routes each token to "
            f"1 to expert_count ({n_expert}) experts; {_FIX}"
        )
    for t in experts:
        if t.shape[-1] != n_expert:
            raise ModelFileError(
                f"{path} is corrupt: tensor {t.name} holds {t.shape[-1]} experts but "
                f"{arch}.expert_count is {n_expert}; {_FIX}"
            )


def check_expert_groups(path: Path, meta: Mapping[str, Any]) -> None:
    """Grouped routing (expert_group_count G, expert_group_used_count g): G below
    expert_count, and for G > 1, expert_count a multiple of G and 0 < g < G; none without
    experts (GGML_ASSERTs in llama_model::load_hparams)."""
    arch = _arch(meta)
    n_expert = _int_field(meta, f"{arch}.expert_count") or 0
    groups = _int_field(meta, f"{arch}.expert_group_count")
    used = _int_field(meta, f"{arch}.expert_group_used_count") or 0
    if groups is None:
        return
    bad = (
        groups != 0
        if n_expert <= 0
        else not 0 <= groups < n_expert or (groups > 1 and (n_expert % groups or not 0 < used < groups))
    )
    if bad:
        raise ModelFileError(
            f"{path} is corrupt: {arch}.expert_group_count is {groups} (expert_group_used_count {used}) with "
            f"{n_expert} experts; the experts split into fewer groups than experts, evenly, and a token "
            f"uses more than none and fewer than all of them; {_FIX}"
        )


def check_expert_gating(path: Path, meta: Mapping[str, Any]) -> None:
    """expert_gating_func is one llama.cpp knows (0-4): another aborts the graph build in
    llm_graph_context::build_moe_ffn (GGML_ABORT "fatal error")."""
    arch = _arch(meta)
    gating = _int_field(meta, f"{arch}.expert_gating_func")
    if gating is not None and gating not in GATING_FUNCS:
        raise ModelFileError(
            f"{path} is corrupt: {arch}.expert_gating_func is {gating}, not one llama.cpp knows "
            f"({GATING_FUNCS.start} to {GATING_FUNCS.stop - 1}); {_FIX}"
        )


def check_norm_epsilon(path: Path, meta: Mapping[str, Any]) -> None:
    """The norms' epsilons are finite and >= 0: a NaN or negative one aborts the first
    decode (GGML_ASSERT(eps >= 0.0f) in ggml's norm kernels)."""
    arch = _arch(meta)
    for suffix in ("layer_norm_rms_epsilon", "layer_norm_epsilon", "group_norm_epsilon"):
        key = f"{arch}.attention.{suffix}"
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, float | int):
            continue
        if not (math.isfinite(value) and value >= 0):
            raise ModelFileError(f"{path} is corrupt: {key} is {value}, not a finite value >= 0; {_FIX}")


def check_attention_temperature(path: Path, meta: Mapping[str, Any]) -> None:
    """Attention temperature tuning (attention.temperature_scale, nonzero) comes with its
    length (attention.temperature_length > 0): the first decode asserts
    n_attn_temp_floor_scale != 0 (llm_graph_input_attn_temp::set_input) otherwise."""
    arch = _arch(meta)
    scale = meta.get(f"{arch}.attention.temperature_scale")
    if not isinstance(scale, float | int) or isinstance(scale, bool) or scale == 0:
        return
    key = f"{arch}.attention.temperature_length"
    length = _int_field(meta, key)
    if length is None or length <= 0:
        raise ModelFileError(
            f"{path} is corrupt: {arch}.attention.temperature_scale is {scale} but "
            f"{key} is {meta.get(key, 'missing')} "
            f"(temperature tuning needs a length > 0); {_FIX}"
        )


def check_rope_scaling(path: Path, meta: Mapping[str, Any]) -> None:
    """rope.scaling.type names one of llama.cpp's (ROPE_SCALING_TYPES): another trips
    GGML_ASSERT(rope_scaling_type_train != UNSPECIFIED) in load_hparams."""
    key = f"{_arch(meta)}.rope.scaling.type"
    value = meta.get(key)
    if isinstance(value, str) and value not in ROPE_SCALING_TYPES:
        raise ModelFileError(
            f"{path} is corrupt: {key} is {value!r}, not one of {', '.join(ROPE_SCALING_TYPES)}; {_FIX}"
        )


def check_vocabulary(path: Path, meta: Mapping[str, Any]) -> None:
    """The token texts are distinct, as llama.cpp reads them (an empty one becomes
    "[EMPTY_<id>]"): GGML_ASSERT(id_to_token.size() == token_to_id.size()) in
    llama_vocab::load. A WordPiece ("bert") vocabulary has no byte tokens: turning one into
    text is GGML_ABORT("fatal error") in llama_vocab::token_to_byte, reached at load."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model in ("no_vocab", "none") or not isinstance(tokens, list):
        return
    seen: dict[bytes, int] = {}
    for i, token in enumerate(tokens):
        text = token if isinstance(token, bytes) else str(token).encode()
        text = text or f"[EMPTY_{i}]".encode()
        first = seen.setdefault(text, i)
        if first != i:
            raise ModelFileError(
                f"{path} is corrupt: tokens {first} and {i} of tokenizer.ggml.tokens are both {text!r} "
                f"(a vocabulary's tokens are distinct); {_FIX}"
            )
    types = meta.get("tokenizer.ggml.token_type")
    if model == "bert" and isinstance(types, list) and _TOKEN_TYPE_BYTE in types:
        raise ModelFileError(
            f"{path} is corrupt: its bert (WordPiece) vocabulary has byte tokens (token_type "
            f"{_TOKEN_TYPE_BYTE}, token {types.index(_TOKEN_TYPE_BYTE)}), which WordPiece does not have; "
            f"{_FIX}"
        )


def _head_sizes(meta: Mapping[str, Any], arch: str) -> tuple[int | None, int | None, int | None]:
    """(key head size, value head size, RoPE dimensions) as llama.cpp derives them:
    key_length / value_length, else n_embd / head_count (of the first layer); the RoPE
    dimensions default to the key head size. With no head_count (or 0) llama.cpp reads
    none of them and takes all three as 0. None where llama.cpp has no value either."""
    n_embd = _int_field(meta, f"{arch}.embedding_length")
    key = f"{arch}.attention.head_count"
    heads = _int_values(meta, key)
    if key not in meta or heads == [0] or (heads and heads[0] == 0):
        return 0, 0, 0
    default = n_embd // heads[0] if n_embd is not None and heads and heads[0] > 0 else None
    k = _int_field(meta, f"{arch}.attention.key_length")
    v = _int_field(meta, f"{arch}.attention.value_length")
    k = default if k is None else k
    v = default if v is None else v
    rope = _int_field(meta, f"{arch}.rope.dimension_count")
    return k, v, k if rope is None else rope


def check_rope_dimensions(path: Path, meta: Mapping[str, Any]) -> None:
    """For the architectures in ROPE_IS_HEAD_SIZE the key head, the value head and the RoPE
    dimensions are one size: their graphs assert n_embd_head == n_embd_head_k == n_rot
    (e.g. src/models/qwen2moe.cpp) when the context is created."""
    arch = _arch(meta)
    if arch not in ROPE_IS_HEAD_SIZE:
        return
    k, v, rope = _head_sizes(meta, arch)
    if k is not None and v is not None and rope is not None and not k == v == rope:
        raise ModelFileError(
            f"{path} is corrupt: {arch} uses one head size for keys, values and RoPE, but the file gives "
            f"key_length {k}, value_length {v} and rope.dimension_count {rope}; {_FIX}"
        )


def check_rope_parity(path: Path, meta: Mapping[str, Any]) -> None:
    """The RoPE dimensions (rope.dimension_count, else the key head size) are even: ggml's
    RoPE turns pairs (GGML_ASSERT(n_dims % 2 == 0), ggml-cpu ops.cpp), and a head size of 1
    (a qwen2moe with head_count 32 over embedding_length 32, from the differential fuzzer)
    tripped GGML_ASSERT(ggml_can_mul_mat(a, b)) as the context was made."""
    arch = _arch(meta)
    if arch == SIDECAR_ARCH:
        return
    k, _v, rope = _head_sizes(meta, arch)
    if rope is not None and rope > 0 and rope % 2:
        raise ModelFileError(
            f"{path} is corrupt: {arch} turns {rope} RoPE dimensions (rope.dimension_count, else the key "
            f"head size, here {k}), and RoPE turns them in pairs: an even number; {_FIX}"
        )


def check_kv_heads(path: Path, meta: Mapping[str, Any]) -> None:
    """Each layer's head_count_kv is at least 1, at most its head_count, and divides it
    (grouped-query attention shares each key/value head among whole groups). llama.cpp keeps
    the key width head size x head_count_kv in 32 bits: head_count_kv 2**30 + 1 over heads
    of 16 wrapped to 16, passed the tensor checks and tripped GGML_ASSERT(ggml_nelements(a)
    == ne0*ne1*ne2) as the context was made (the differential fuzzer)."""
    arch = _arch(meta)
    if arch == SIDECAR_ARCH:
        return
    heads = _int_values(meta, f"{arch}.attention.head_count")
    kv = _int_values(meta, f"{arch}.attention.head_count_kv")
    if not heads or not kv:
        return  # llama.cpp defaults head_count_kv to head_count; other rules see to head_count
    for il in range(max(len(heads), len(kv))):
        h = heads[il] if il < len(heads) else heads[-1]
        k = kv[il] if il < len(kv) else kv[-1]
        if h > 0 and not (1 <= k <= h and h % k == 0):
            raise ModelFileError(
                f"{path} is corrupt: {arch} layer {il} has head_count {h} and head_count_kv {k}; "
                f"head_count_kv must be between 1 and head_count and divide it; {_FIX}"
            )


def check_uniform_layers(path: Path, meta: Mapping[str, Any]) -> None:
    """For the architectures of ROPE_IS_HEAD_SIZE and deepseek2, head_count, head_count_kv and
    expert_used_count, when given per layer, are one value. Their graphs size every layer
    by one value where llama.cpp's shared code takes each layer's: attention tensors made
    with layer 0's heads but a KV cache with each layer's fail the first decode
    (GGML_ASSERT(a->ne[0] == b->ne[0]) in ggml_set_rows), and per-layer expert counts
    fail it in a view past its source (GGML_ASSERT(... <= ggml_nbytes(view_src)) in
    ggml_view), with the hook unregistered too."""
    arch = _arch(meta)
    if arch not in ROPE_IS_HEAD_SIZE and arch != "deepseek2":
        return
    for suffix in ("attention.head_count", "attention.head_count_kv", "expert_used_count"):
        key = f"{arch}.{suffix}"
        values = _int_values(meta, key)
        if values is not None and len(set(values)) > 1:
            raise ModelFileError(
                f"{path} is corrupt: {key} is {values}, but {arch} has one value for every layer; {_FIX}"
            )


def check_mla_dimensions(path: Path, meta: Mapping[str, Any]) -> None:
    """deepseek2's attention: the query/key head (key_length_mla under MLA) is wider than
    its RoPE part (GGML_ASSERT(n_embd_head_qk_nope >= 1)); under MLA (key_length_mla and
    value_length_mla set) the cache holds one latent head: head_count_kv 1, key_length
    kv_lora_rank + rope.dimension_count, value_length kv_lora_rank (otherwise the KV cache
    rows do not match the latent and the first decode aborts in ggml_set_rows)."""
    arch = _arch(meta)
    if arch != "deepseek2":
        return
    k, _, rope = _head_sizes(meta, arch)
    k_mla = _int_field(meta, f"{arch}.attention.key_length_mla")
    v_mla = _int_field(meta, f"{arch}.attention.value_length_mla")
    mla = bool(k_mla) and bool(v_mla)
    qk = k_mla if mla else k
    if qk is not None and rope is not None and qk - rope < 1:
        no_heads = " (with no attention.head_count, llama.cpp takes both as 0)" if (k, rope) == (0, 0) else ""
        raise ModelFileError(
            f"{path} is corrupt: {arch}'s query/key head ({'key_length_mla' if mla else 'key_length'} {qk}) "
            f"must be wider than its RoPE part (rope.dimension_count {rope}){no_heads}; {_FIX}"
        )
    if not mla:
        return
    kv_lora = _int_field(meta, f"{arch}.attention.kv_lora_rank")
    # head_count_kv defaults to head_count in llama.cpp
    heads_kv = _int_values(meta, f"{arch}.attention.head_count_kv") or _int_values(
        meta, f"{arch}.attention.head_count"
    )
    v = _int_field(meta, f"{arch}.attention.value_length")
    if kv_lora is None or rope is None:
        return  # llama.cpp refuses a missing kv_lora_rank by itself
    if (
        (heads_kv is not None and set(heads_kv) != {1})
        or (k is not None and k != kv_lora + rope)
        or (v is not None and v != kv_lora)
    ):
        raise ModelFileError(
            f"{path} is corrupt: {arch} with MLA caches one latent head, so head_count_kv is 1, key_length "
            f"kv_lora_rank + rope.dimension_count ({kv_lora} + {rope}) and value_length kv_lora_rank "
            f"({kv_lora}), but the file gives {heads_kv}, {k} and {v}; "
            f"{_FIX}"
        )


def validate_header(
    path: Path, meta: Mapping[str, Any], tensors: Sequence[_Tensor], alignment: int, header_end: int
) -> None:
    """Every rule above, in the order a reader would want the first error (`header_end`:
    where the tensor directory ends; the data section starts at the next alignment)."""
    check_dimensions(path, tensors)
    check_alignment(path, tensors, alignment)
    check_tensor_placement(path, tensors, (header_end + alignment - 1) // alignment * alignment)
    check_tensor_packing(path, tensors, alignment)
    check_tensor_types(path, meta, tensors)
    check_vector_types(path, meta, tensors)
    check_block_count(path, meta)
    check_moe_metadata(path, meta, tensors)
    check_expert_groups(path, meta)
    check_expert_gating(path, meta)
    check_norm_epsilon(path, meta)
    check_attention_temperature(path, meta)
    check_rope_scaling(path, meta)
    check_rope_dimensions(path, meta)
    check_rope_parity(path, meta)
    check_uniform_layers(path, meta)
    check_mla_dimensions(path, meta)
    check_kv_heads(path, meta)
    check_vocabulary(path, meta)
