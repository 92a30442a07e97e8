"""Random-weight MoE GGUFs in llama.cpp's `qwen2moe` and `deepseek2` layouts.

Tests need MoE models that load in the pinned llama.cpp, build in seconds and
run the same graph code as the real models; timing runs need the real widths
without the real weights. Both come from here: every tensor is seeded noise,
written F32 with the `gguf` package and, if asked, quantized by our
`llama-quantize`.

The layout follows the pinned llama.cpp itself (src/models/qwen2moe.cpp,
src/models/deepseek2.cpp, src/llama-model.cpp, src/llama-arch.cpp); key and
tensor names are spelled out here rather than taken from the gguf package, so
an older gguf wheel cannot change what we write. Facts that shaped it:

* qwen2moe: separate attn_q/k/v, each with a bias; `output.weight` is required
  (no tied-embedding fallback); one shared expert whose output is scaled by
  sigmoid(ffn_gate_inp_shexp . x), computed as silu(g) / g, so g == 0 is NaN.
* deepseek2: MLA in the split form current llama.cpp uses (attn_k_b, attn_v_b,
  with key_length_mla / value_length_mla set; the merged attn_kv_b is legacy)
  and the KV cache stored as one head (head_count_kv = 1, key_length =
  kv_lora_rank + rope dims, value_length = kv_lora_rank). Queries use a plain
  attn_q as in DeepSeek-V2-Lite; the loader only treats 26- or 27-layer files
  as Lite and otherwise *requires* attention.q_lora_rank, so we always write
  q_lora_rank = 0, which selects attn_q at any depth.
* Every tensor the file holds must be used by the loader, so nothing extra is
  written (no attn_kv_b next to attn_k_b / attn_v_b).

The tokenizer is copied from a vocabulary-only GGUF that ships with the pinned
upstream (models/ggml-vocab-*.gguf): tiny shapes use llama-spm (32000 tokens),
the real shapes the family's own vocabulary at the published vocab_size, so
token_embd / output have the real model's rows and a prompt tokenizes as it
would for the real model. A vocabulary shorter than the shape's n_vocab is
padded as upstream's converter pads: "[PAD<id>]" tokens of type UNUSED (score
-1000 where the vocabulary has scores), appended after every real token, so
no id moves and llama.cpp never matches them as special tokens.

Weights are N(0, 1/fan_in) so activations stay O(1) through the layers; the
router is 4x that so routing is peaked rather than uniform; norms are
1 + small noise. Generation is deterministic: every tensor is cut into row
chunks of a fixed size and each chunk draws from its own generator, seeded
from (seed, tensor name, chunk index), so equal arguments give byte-identical
files (for a given numpy), threads only change the speed, and `layers=N` gives
exactly the first N layers' tensors of the full-depth model. Chunks are
written as they are made, so memory stays at a few hundred MiB and disk at the
file's own size (plus the temporary when quantizing), whatever the shape.
The temporary a quantized file is made from holds the routed experts in F16,
the rest in F32: the experts are nearly all of a real shape's bytes, so a
full-depth DeepSeek-V2-Lite's temporary is about 31 GB rather than 62 GB and
fits a 64 GiB disk beside its output, and llama-quantize reads half as much;
the tensors llama-quantize keeps unquantized (norms, routers) stay F32.
"""

from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, GGUFWriter
from tqdm import tqdm

from pyspice.build_info import load_build_info
from pyspice.formats.gguf_header import GGUF_MAGIC, KeyValue, parse_header
from pyspice.formats.tensor_names import is_routed_expert

ARCHS: tuple[str, ...] = ("qwen2moe", "deepseek2")

_RMS_EPS = 1e-6
_ROPE_FREQ_BASE = {"qwen2moe": 1_000_000.0, "deepseek2": 10_000.0}  # as in the real models
_ROUTER_GAIN = 4.0  # router logits ~N(0, 16): top-k picks clear winners, like trained routers
_NORM_NOISE = 0.02
_BIAS_SCALE = 0.1
_CHUNK_ELEMS = 1 << 22  # 16 MiB of F32 per generated chunk; fixed, so bytes never depend on memory
_MAX_WORKERS = 8  # generator threads; more would outrun the disk
_LLAMA_FTYPE_ALL_F32 = 0
_LLAMA_GATING_SOFTMAX = 1  # llama_expert_gating_func_type: DeepSeek-V2 routes with softmax
_TOKEN_TYPE_UNUSED = 5  # llama_token_type; upstream's converter gives its [PAD<id>] tokens this type
_PAD_SCORE = -1000.0  # upstream's converter's score for SentencePiece padding tokens


@dataclass(frozen=True)
class SynthShape:
    """Every width of one synthetic model; fields an arch does not use are ignored by it."""

    name: str
    archs: tuple[str, ...]  # architectures this shape is defined for
    n_embd: int
    n_layer: int
    n_head: int
    n_ctx: int  # context_length written to the file (the training context)
    n_expert: int  # routed experts per MoE layer
    n_expert_used: int  # top-k
    n_ff_exp: int  # routed expert FFN width
    n_ff: int  # feed_forward_length: deepseek2's dense-layer FFN width; qwen2moe records its dense width
    vocab: str = "llama-spm"  # the tokenizer: upstream's models/ggml-vocab-<vocab>.gguf
    n_vocab: int | None = None  # pad the token list to this (a published vocab_size); None: the file's count
    # qwen2moe only
    n_head_kv: int = 0  # GQA key/value heads; head size is n_embd / n_head
    n_ff_shexp: int = 0  # width of the one sigmoid-gated shared expert
    # deepseek2 only
    n_dense_lead: int = 0  # leading layers with a dense FFN instead of MoE
    n_expert_shared: int = 0  # shared experts, fused into one FFN of width n_expert_shared * n_ff_exp
    kv_lora_rank: int = 0  # MLA latent width
    qk_nope_dim: int = 0  # per-head query/key width without RoPE
    qk_rope_dim: int = 0  # per-head query/key width with RoPE (the key part is shared by all heads)
    v_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# deepseek2 shapes keep DeepSeek-V2's MLA geometry even when tiny (latent 512,
# rope 64, nope 128, v 128), so the KV cache has its real 576/512 layout and
# a GPU runs the same attention kernels as for the real model.
_TINY = SynthShape(
    name="tiny",
    archs=ARCHS,
    n_embd=256,
    n_layer=4,
    n_head=4,
    n_ctx=512,
    n_expert=8,
    n_expert_used=2,
    n_ff_exp=256,
    n_ff=512,
    n_head_kv=2,
    n_ff_shexp=512,
    n_dense_lead=1,
    n_expert_shared=2,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
)

SHAPES: dict[str, SynthShape] = {
    "tiny": _TINY,
    # Widths as DeepSeek-V2-Lite has them relative to 256-element K-quant
    # blocks: the expert width (1408 = 5.5 x 256) and the dense width
    # (10944 = 42.75 x 256) are not multiples of 256 but are of 32, so their
    # ffn_down rows fall back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), while
    # the 2-expert shared width (2816 = 11 x 256) is, and does not.
    "tiny-odd": replace(_TINY, name="tiny-odd", n_ff_exp=384, n_ff=576),
    "qwen2-57b-a14b": SynthShape(
        name="qwen2-57b-a14b",
        archs=("qwen2moe",),
        n_embd=3584,
        n_layer=28,
        n_head=28,
        n_ctx=32768,
        n_expert=64,
        n_expert_used=8,
        n_ff_exp=2560,
        n_ff=18944,
        # Qwen2's tokenizer has 151646 tokens, padded to the published vocab_size; upstream's
        # file already holds the padded 151936, so n_vocab there pins the count rather than pads
        vocab="qwen2",
        n_vocab=151936,
        n_head_kv=4,
        n_ff_shexp=20480,
    ),
    "deepseek-v2-lite": SynthShape(
        name="deepseek-v2-lite",
        archs=("deepseek2",),
        n_embd=2048,
        n_layer=27,
        n_head=16,
        n_ctx=4096,  # the pre-YaRN context; we write no YaRN scaling
        n_expert=64,
        n_expert_used=6,
        n_ff_exp=1408,
        n_ff=10944,
        # DeepSeek-V2 uses DeepSeek-LLM's tokenizer: 100015 tokens, padded to the published
        # vocab_size (upstream's file already holds the padded 102400)
        vocab="deepseek-llm",
        n_vocab=102400,
        n_dense_lead=1,
        n_expert_shared=2,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
    ),
}


@dataclass(frozen=True)
class QuantSpec:
    """How `llama-quantize` is asked for one of our quant names."""

    tool_type: str  # the type argument llama-quantize parses
    pure: bool  # --pure: every quantizable tensor gets the type's default (no per-tensor mix)


# Single-type names use --pure so expert tensors really get that type (only
# shape fallbacks change it). In llama-quantize "Q4_K" / "Q5_K" / "Q3_K" are
# aliases of the _M mixes; with --pure the mix reduces to its default type.
QUANTS: dict[str, QuantSpec] = {
    **{name: QuantSpec(name, pure=True) for name in ("F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")},
    **{name: QuantSpec(name, pure=True) for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
    **{name: QuantSpec(name, pure=False) for name in ("Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M")},
}


@dataclass(frozen=True)
class SynthTensor:
    """One tensor of the plan: values are offset + scale * N(0, 1), stored F32 (the
    routed experts F16 in a temporary that llama-quantize reads, `synthesize`)."""

    name: str
    shape: tuple[int, ...]  # numpy order, outermost first: GGUF's ne reversed
    scale: float
    offset: float = 0.0

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)

    @property
    def routed_experts(self) -> bool:
        return is_routed_expert(self.name)


def shape_for(arch: str, shape: str, layers: int | None = None) -> SynthShape:
    """The validated shape for `arch`, with its depth limited to `layers` when given."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    dims = SHAPES.get(shape)
    if dims is None:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if arch not in dims.archs:
        raise ValueError(f"shape {shape!r} is defined for {', '.join(dims.archs)}, not {arch!r}")
    if layers is None:
        return dims
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    return replace(dims, n_layer=layers, n_dense_lead=min(dims.n_dense_lead, layers))


def quant_spec(quant: str | None) -> QuantSpec | None:
    """The llama-quantize request for `quant`; None means write F32 directly."""
    if quant is None or quant.strip().upper() == "F32":
        return None
    spec = QUANTS.get(quant.strip().upper())
    if spec is None:
        raise ValueError(f"unknown quant {quant!r}; choose F32 or one of {', '.join(QUANTS)}")
    return spec


def _matrix(name: str, *shape: int, gain: float = 1.0) -> SynthTensor:
    # GGUF's ne[0] (numpy's last axis) is the input width that ggml_mul_mat contracts over.
    return SynthTensor(name, shape, gain / math.sqrt(shape[-1]))


def _norm(name: str, width: int) -> SynthTensor:
    return SynthTensor(name, (width,), _NORM_NOISE, 1.0)


def _routed_experts(p: str, s: SynthShape) -> list[SynthTensor]:
    return [
        _matrix(f"{p}.ffn_gate_inp.weight", s.n_expert, s.n_embd, gain=_ROUTER_GAIN),
        _matrix(f"{p}.ffn_gate_exps.weight", s.n_expert, s.n_ff_exp, s.n_embd),
        _matrix(f"{p}.ffn_up_exps.weight", s.n_expert, s.n_ff_exp, s.n_embd),
        _matrix(f"{p}.ffn_down_exps.weight", s.n_expert, s.n_embd, s.n_ff_exp),
    ]


def _ffn(p: str, suffix: str, n_embd: int, width: int) -> list[SynthTensor]:
    return [
        _matrix(f"{p}.ffn_gate{suffix}.weight", width, n_embd),
        _matrix(f"{p}.ffn_up{suffix}.weight", width, n_embd),
        _matrix(f"{p}.ffn_down{suffix}.weight", n_embd, width),
    ]


def _qwen2moe_block(p: str, s: SynthShape) -> list[SynthTensor]:
    n_kv = s.n_head_kv * s.head_dim
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd),
        _matrix(f"{p}.attn_q.weight", s.n_embd, s.n_embd),
        SynthTensor(f"{p}.attn_q.bias", (s.n_embd,), _BIAS_SCALE),
        _matrix(f"{p}.attn_k.weight", n_kv, s.n_embd),
        SynthTensor(f"{p}.attn_k.bias", (n_kv,), _BIAS_SCALE),
        _matrix(f"{p}.attn_v.weight", n_kv, s.n_embd),
        SynthTensor(f"{p}.attn_v.bias", (n_kv,), _BIAS_SCALE),
        _matrix(f"{p}.attn_output.weight", s.n_embd, s.n_embd),
        _norm(f"{p}.ffn_norm.weight", s.n_embd),
        *_routed_experts(p, s),
        # 1-D gate vector: its dot with the normed input is the shared expert's
        # sigmoid logit, ~N(0, 1) at this scale. Gaussian draws are never all
        # zero, so the silu(g)/g sigmoid never sees an identically zero g.
        SynthTensor(f"{p}.ffn_gate_inp_shexp.weight", (s.n_embd,), 1.0 / math.sqrt(s.n_embd)),
        *_ffn(p, "_shexp", s.n_embd, s.n_ff_shexp),
    ]


def _deepseek2_block(p: str, s: SynthShape, dense: bool) -> list[SynthTensor]:
    ffn = (
        _ffn(p, "", s.n_embd, s.n_ff)
        if dense
        else [*_routed_experts(p, s), *_ffn(p, "_shexp", s.n_embd, s.n_expert_shared * s.n_ff_exp)]
    )
    return [
        _norm(f"{p}.attn_norm.weight", s.n_embd),
        _matrix(f"{p}.attn_q.weight", s.n_head * (s.qk_nope_dim + s.qk_rope_dim), s.n_embd),
        _matrix(f"{p}.attn_kv_a_mqa.weight", s.kv_lora_rank + s.qk_rope_dim, s.n_embd),
        _norm(f"{p}.attn_kv_a_norm.weight", s.kv_lora_rank),
        # ne {qk_nope, kv_lora_rank, n_head}: absorbs the no-RoPE query into the latent
        _matrix(f"{p}.attn_k_b.weight", s.n_head, s.kv_lora_rank, s.qk_nope_dim),
        # ne {kv_lora_rank, v_head, n_head}: expands the attended latent to per-head values
        _matrix(f"{p}.attn_v_b.weight", s.n_head, s.v_head_dim, s.kv_lora_rank),
        _matrix(f"{p}.attn_output.weight", s.n_embd, s.n_head * s.v_head_dim),
        _norm(f"{p}.ffn_norm.weight", s.n_embd),
        *ffn,
    ]


def tensor_plan(arch: str, dims: SynthShape, n_vocab: int) -> list[SynthTensor]:
    """Every tensor of the file, in file order."""
    blocks: list[SynthTensor] = []
    for i in range(dims.n_layer):
        if arch == "qwen2moe":
            blocks += _qwen2moe_block(f"blk.{i}", dims)
        else:
            blocks += _deepseek2_block(f"blk.{i}", dims, dense=i < dims.n_dense_lead)
    return [
        SynthTensor("token_embd.weight", (n_vocab, dims.n_embd), 1.0),
        *blocks,
        _norm("output_norm.weight", dims.n_embd),
        _matrix("output.weight", n_vocab, dims.n_embd),
    ]


def _model_kv(arch: str, dims: SynthShape, n_vocab: int, seed: int) -> list[KeyValue]:
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    common = [
        KeyValue("general.name", f"pyspice-synth-{arch}-{dims.name}", GGUFValueType.STRING),
        KeyValue("general.file_type", _LLAMA_FTYPE_ALL_F32, u32),  # llama-quantize rewrites it
        KeyValue("general.quantization_version", GGML_QUANT_VERSION, u32),
        KeyValue("pyspice.synth.shape", dims.name, GGUFValueType.STRING),
        KeyValue("pyspice.synth.seed", seed, GGUFValueType.UINT64),
        KeyValue(f"{arch}.vocab_size", n_vocab, u32),
        KeyValue(f"{arch}.context_length", dims.n_ctx, u32),
        KeyValue(f"{arch}.embedding_length", dims.n_embd, u32),
        KeyValue(f"{arch}.block_count", dims.n_layer, u32),
        KeyValue(f"{arch}.feed_forward_length", dims.n_ff, u32),
        KeyValue(f"{arch}.attention.head_count", dims.n_head, u32),
        KeyValue(f"{arch}.attention.layer_norm_rms_epsilon", _RMS_EPS, f32),
        KeyValue(f"{arch}.rope.freq_base", _ROPE_FREQ_BASE[arch], f32),
        KeyValue(f"{arch}.expert_count", dims.n_expert, u32),
        KeyValue(f"{arch}.expert_used_count", dims.n_expert_used, u32),
        KeyValue(f"{arch}.expert_feed_forward_length", dims.n_ff_exp, u32),
    ]
    if arch == "qwen2moe":
        return [
            *common,
            KeyValue(f"{arch}.attention.head_count_kv", dims.n_head_kv, u32),
            KeyValue(f"{arch}.expert_shared_feed_forward_length", dims.n_ff_shexp, u32),
        ]
    return [
        *common,
        KeyValue(f"{arch}.attention.head_count_kv", 1, u32),  # MLA caches one latent "head"
        KeyValue(f"{arch}.attention.key_length", dims.kv_lora_rank + dims.qk_rope_dim, u32),
        KeyValue(f"{arch}.attention.value_length", dims.kv_lora_rank, u32),
        KeyValue(f"{arch}.attention.key_length_mla", dims.qk_nope_dim + dims.qk_rope_dim, u32),
        KeyValue(f"{arch}.attention.value_length_mla", dims.v_head_dim, u32),
        KeyValue(f"{arch}.attention.q_lora_rank", 0, u32),
        KeyValue(f"{arch}.attention.kv_lora_rank", dims.kv_lora_rank, u32),
        KeyValue(f"{arch}.rope.dimension_count", dims.qk_rope_dim, u32),
        KeyValue(f"{arch}.leading_dense_block_count", dims.n_dense_lead, u32),
        KeyValue(f"{arch}.expert_shared_count", dims.n_expert_shared, u32),
        KeyValue(f"{arch}.expert_weights_scale", 1.0, f32),
        KeyValue(f"{arch}.expert_weights_norm", False, GGUFValueType.BOOL),
        KeyValue(f"{arch}.expert_gating_func", _LLAMA_GATING_SOFTMAX, u32),
    ]


def _read_metadata(path: Path) -> tuple[list[KeyValue], dict[str, GGMLQuantizationType]]:
    """All key/values (strings as raw bytes, for an exact copy), and each tensor's type by name."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if mapped[:4] != GGUF_MAGIC:
                raise ValueError("not a GGUF file")
            header = parse_header(mapped, path, raw_strings=True)
        if header.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {header.version} (a big-endian file?)")
        return header.metadata, {t.name: GGMLQuantizationType(t.type_id) for t in header.tensors}
    except ValueError as exc:  # ModelFileError too: a truncated file
        raise ValueError(f"{path}: cannot read GGUF metadata: {exc}") from exc


def tensor_types(path: Path) -> dict[str, str]:
    """Tensor name -> ggml type name (F32, Q4_K, ...) of a GGUF, e.g. to see what quantizing gave."""
    return {name: qtype.name for name, qtype in _read_metadata(path)[1].items()}


def read_vocab(path: Path) -> tuple[list[KeyValue], int]:
    """The `tokenizer.*` metadata of a GGUF, ready to copy, and its token count."""
    kvs = [kv for kv in _read_metadata(path)[0] if kv.key.startswith("tokenizer.")]
    for kv in kvs:
        if kv.sub_type == GGUFValueType.ARRAY:
            raise ValueError(f"{path}: {kv.key} is a nested array, which we do not copy")
    # the writer cannot store an empty array; llama.cpp reads a missing one as empty
    kvs = [kv for kv in kvs if kv.vtype != GGUFValueType.ARRAY or kv.value]
    tokens = next((kv.value for kv in kvs if kv.key == "tokenizer.ggml.tokens"), None)
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens array")
    return kvs, len(tokens)


def pad_vocab(tokenizer: list[KeyValue], n_vocab: int) -> list[KeyValue]:
    """`tokenizer` (as `read_vocab` gives it) with its per-token arrays padded to `n_vocab` tokens.

    Appends "[PAD<id>]" tokens of type UNUSED, as upstream's converter does when
    a model's vocab_size exceeds its tokenizer: they come after every real
    token, so no id moves, and llama.cpp leaves UNUSED tokens out of
    special-token matching. Merges are pairs of existing tokens and stay as
    they are.
    """
    by_key = {kv.key: kv for kv in tokenizer}
    tokens = by_key.get("tokenizer.ggml.tokens")
    if tokens is None or not isinstance(tokens.value, list):
        raise ValueError("the vocabulary has no tokenizer.ggml.tokens array")
    n_tokens = len(tokens.value)
    if n_vocab < n_tokens:
        raise ValueError(f"cannot pad a {n_tokens}-token vocabulary down to {n_vocab} tokens")
    ids = range(n_tokens, n_vocab)
    pads = [f"[PAD{i}]".encode() for i in ids]
    if not set(pads).isdisjoint(tokens.value):
        # token_to_id is a map: a duplicate text would leave an id unreachable
        raise ValueError("the vocabulary already has a [PAD<id>] token past its end")
    fill: dict[str, list[Any]] = {
        "tokenizer.ggml.tokens": pads,
        "tokenizer.ggml.token_type": [_TOKEN_TYPE_UNUSED] * len(ids),
        "tokenizer.ggml.scores": [_PAD_SCORE] * len(ids),
    }
    padded: list[KeyValue] = []
    for kv in tokenizer:
        extra = fill.get(kv.key)
        if extra is not None and isinstance(kv.value, list):
            if len(kv.value) != n_tokens:
                raise ValueError(f"{kv.key} has {len(kv.value)} entries for {n_tokens} tokens")
            kv = replace(kv, value=[*kv.value, *extra])
        padded.append(kv)
    return padded


def load_vocab(dims: SynthShape, vocab: Path | None = None) -> tuple[list[KeyValue], int]:
    """The tokenizer keys a model of `dims` gets, and its n_vocab.

    `vocab` replaces the shape's upstream vocabulary file; either is padded to
    the shape's n_vocab when it has one.
    """
    path = Path(vocab) if vocab is not None else load_build_info().vocab(dims.vocab)
    tokenizer, n_tokens = read_vocab(path)
    if dims.n_vocab is None or dims.n_vocab == n_tokens:
        return tokenizer, n_tokens
    try:
        return pad_vocab(tokenizer, dims.n_vocab), dims.n_vocab
    except ValueError as exc:
        raise ValueError(f"{path}: shape {dims.name!r}: {exc}") from exc


@dataclass(frozen=True)
class _Chunk:
    """The `index`-th run of `rows` rows of a tensor viewed as (rows, ne[0]); `index` seeds it."""

    spec: SynthTensor
    index: int
    rows: int


def _chunks(spec: SynthTensor) -> Iterator[_Chunk]:
    cols = spec.shape[-1]
    total = math.prod(spec.shape[:-1])
    per_chunk = max(1, _CHUNK_ELEMS // cols)
    for index, start in enumerate(range(0, total, per_chunk)):
        yield _Chunk(spec, index, min(per_chunk, total - start))


def _fill(chunk: _Chunk, seed: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    spec = chunk.spec
    seq = np.random.SeedSequence(seed, spawn_key=(zlib.crc32(spec.name.encode()), chunk.index))
    values = np.random.Generator(np.random.PCG64(seq)).standard_normal(
        (chunk.rows, spec.shape[-1]), dtype=np.float32
    )
    values *= np.float32(spec.scale)
    values += np.float32(spec.offset)
    return values.astype(dtype.newbyteorder("<"), copy=False)  # GGUF is little-endian


def _values(
    plan: list[SynthTensor], seed: int, dtype_of: dict[str, np.dtype[Any]]
) -> Iterator[tuple[SynthTensor, npt.NDArray[Any]]]:
    """Every chunk of every tensor, in file order, filled by a few threads.

    Each chunk has its own generator, so threads change only the speed, never
    the bytes; numpy fills and scales with the GIL released. At most `window`
    chunks are in flight, which bounds memory.
    """
    workers = min(_MAX_WORKERS, os.cpu_count() or 1)
    window = 2 * workers
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[tuple[SynthTensor, Future[npt.NDArray[Any]]]] = deque()
        for spec in plan:
            for chunk in _chunks(spec):
                pending.append((spec, pool.submit(_fill, chunk, seed, dtype_of[spec.name])))
                if len(pending) >= window:
                    head, values = pending.popleft()
                    yield head, values.result()
        while pending:
            head, values = pending.popleft()
            yield head, values.result()


def _write_floats(
    path: Path,
    arch: str,
    dims: SynthShape,
    seed: int,
    tokenizer: list[KeyValue],
    n_vocab: int,
    progress: bool,
    experts_f16: bool = False,
) -> None:
    """Header, metadata and tensor infos via GGUFWriter; tensor data streamed chunk by
    chunk. Every tensor F32, or with `experts_f16` the routed experts F16 (the same
    values rounded; a temporary for llama-quantize, module docstring)."""
    plan = tensor_plan(arch, dims, n_vocab)
    dtype_of = {
        spec.name: np.dtype(np.float16 if experts_f16 and spec.routed_experts else np.float32)
        for spec in plan
    }
    writer = GGUFWriter(path, arch)
    try:
        for kv in [*_model_kv(arch, dims, n_vocab, seed), *tokenizer]:
            writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
        for spec in plan:
            dtype = dtype_of[spec.name]
            writer.add_tensor_info(spec.name, spec.shape, dtype, dtype.itemsize * math.prod(spec.shape))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None and len(writer.fout) == 1
        fout = writer.fout[0]
        total = sum(dtype_of[spec.name].itemsize * math.prod(spec.shape) for spec in plan)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"synth {arch} {dims.name}",
            file=sys.stderr,
            disable=not progress,
        ) as bar:
            current: SynthTensor | None = None
            for spec, values in _values(plan, seed, dtype_of):
                if spec is not current:
                    # GGUFWriter's data layout: every tensor starts at an aligned offset
                    writer.write_padding(fout, fout.tell())
                    current = spec
                fout.write(values.data)
                bar.update(values.nbytes)
            writer.write_padding(fout, fout.tell())
    finally:
        writer.close()


def _temp_sibling(out: Path, suffix: str) -> Path:
    # Next to `out`, so the final rename stays on one filesystem and disk use is
    # bounded by this model's own files; named rather than mkstemp'd so the file
    # gets the usual umask permissions.
    return out.parent / f".{out.name}.{os.getpid()}{suffix}"


def _run_quantize(tool: Path, src: Path, out: Path, spec: QuantSpec, progress: bool) -> None:
    tmp = _temp_sibling(out, ".quant.tmp")
    try:
        cmd = [str(tool), *(["--pure"] if spec.pure else []), str(src), str(tmp), spec.tool_type]
        # With progress its per-tensor log is the progress report; otherwise it is kept for errors.
        result = subprocess.run(
            cmd,
            stdout=sys.stderr if progress else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            log = (result.stdout or "")[-4000:]
            raise RuntimeError(f"llama-quantize exited with {result.returncode}: {' '.join(cmd)}\n{log}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def quantize(src: Path, out: Path, quant: str, *, progress: bool = False) -> Path:
    """Quantize an F32 GGUF with our llama-quantize; `out` appears only when it succeeds."""
    spec = quant_spec(quant)
    if spec is None:
        raise ValueError("F32 is what synthesize writes directly; there is nothing to quantize to")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _run_quantize(load_build_info().tool("llama-quantize"), Path(src), out, spec, progress)
    return out


def synthesize(
    arch: str,
    shape: str,
    out: Path,
    *,
    quant: str | None = None,
    layers: int | None = None,
    seed: int = 0,
    vocab: Path | None = None,
    progress: bool = False,
) -> Path:
    """Write a random-weight `arch` model of `shape` to `out` and return `out`.

    `vocab` is a vocabulary-only GGUF whose tokenizer.* keys are copied (default:
    the shape's upstream vocabulary, e.g. ggml-vocab-llama-spm.gguf with 32000
    tokens for the tiny shapes); n_vocab is its token count, or the shape's
    published n_vocab, to which the tokens are padded. `quant` other than
    None/F32 writes a temporary next to `out` (routed experts F16, the rest F32) and
    runs llama-quantize on it.
    """
    dims = shape_for(arch, shape, layers)
    spec = quant_spec(quant)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    tokenizer, n_vocab = load_vocab(dims, vocab)
    # look the tool up first: fail before writing gigabytes, not after
    tool = load_build_info().tool("llama-quantize") if spec is not None else None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(out, ".float.tmp")
    try:
        _write_floats(tmp, arch, dims, seed, tokenizer, n_vocab, progress, experts_f16=spec is not None)
        if tool is None or spec is None:
            os.replace(tmp, out)
        else:
            _run_quantize(tool, tmp, out, spec, progress)
    finally:
        tmp.unlink(missing_ok=True)
    return out
