"""The draft predictor: routing several MoE layers ahead (the paper's Algorithm 1).

Per MoE layer l, a low-rank affine transition predicts the next MoE layer's
input from this one, h' ≈ c_l + U_l V_l h (U [n_embd, r], V [r, n_embd]); the
target model's own router of that next layer turns the predicted input into
routing probabilities. Rolled out d layers, the prediction is exact algebra on
the r-dimensional code z = V h, so after the first step every step costs
O(r² + r·n_expert) instead of O(n_embd²):

    z_0 = V_l h
    logits_{l+1} = W_{l+1} c_l + (W_{l+1} U_l) z_0
    z_1 = V_{l+1} c_l + (V_{l+1} U_l) z_0 ...

All products are precomputed once, in float32. Router logits become
probabilities as the architecture does it in llama.cpp's build_moe_ffn:
softmax for qwen2moe and for deepseek2 (V2 / V2-Lite; sigmoid only for V3-style
models whose GGUF says expert_gating_func = sigmoid).

Pure numpy: no native imports (the simulator uses the same object).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
GATINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Transition:
    """h_next ≈ bias + U (V h) for one MoE layer."""

    U: F32  # [n_embd, r]
    V: F32  # [r, n_embd]
    bias: F32  # [n_embd]

    @property
    def rank(self) -> int:
        return int(self.V.shape[0])

    def apply(self, h: npt.ArrayLike) -> F32:
        x = np.asarray(h, dtype=np.float32)
        return _f32((x @ self.V.T) @ self.U.T + self.bias)


def _f32(a: npt.ArrayLike) -> F32:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32))


def gate_probs(logits: F32, gating: str = "softmax") -> F32:
    """Router logits [..., n_expert] -> probabilities, as the architecture computes them."""
    if gating == "sigmoid":
        return _f32(1.0 / (1.0 + np.exp(-logits)))
    m = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - m)
    res: F32 = e / e.sum(axis=-1, keepdims=True)
    return res


def top_k(probs: npt.ArrayLike, k: int) -> npt.NDArray[np.intp]:
    """Indices of the k largest entries along the last axis (unordered)."""
    p = np.asarray(probs)
    if k >= p.shape[-1]:
        return np.broadcast_to(np.arange(p.shape[-1]), p.shape).copy()
    return np.argpartition(-p, k - 1, axis=-1)[..., :k]


class DraftPredictor:
    """Draft rollout over the MoE layers `moe_layers` (ascending).

    routers: layer -> router weights [n_expert, n_embd] for every MoE layer.
    transitions: layer -> Transition from that MoE layer's input to the next
        MoE layer's input (the last MoE layer has none).
    """

    def __init__(
        self,
        moe_layers: Sequence[int],
        routers: Mapping[int, npt.ArrayLike],
        transitions: Mapping[int, Transition],
        gating: str = "softmax",
    ) -> None:
        if gating not in GATINGS:
            raise ValueError(f"unknown gating {gating!r}; choose one of {GATINGS}")
        self.moe_layers = [int(il) for il in sorted(moe_layers)]
        self.gating = gating
        self.routers: dict[int, F32] = {il: _f32(routers[il]) for il in self.moe_layers}
        self.transitions: dict[int, Transition] = {
            il: Transition(_f32(t.U), _f32(t.V), _f32(t.bias)) for il, t in transitions.items()
        }
        self._next: dict[int, int] = {
            a: b for a, b in zip(self.moe_layers, self.moe_layers[1:], strict=False) if a in self.transitions
        }
        # latent-space rollout factors, per source layer l with next MoE layer m = next(l):
        # logits_m = g_m + G_m z_l ; z_m = s_m + S_m z_l   (z_l = V_l h_l)
        self._G: dict[int, F32] = {}
        self._g: dict[int, F32] = {}
        self._S: dict[int, F32] = {}
        self._s: dict[int, F32] = {}
        for il, m in self._next.items():
            t = self.transitions[il]
            w = self.routers[m]
            self._G[il] = _f32(w @ t.U)
            self._g[il] = _f32(w @ t.bias)
            nt = self.transitions.get(m)
            if nt is not None:
                self._S[il] = _f32(nt.V @ t.U)
                self._s[il] = _f32(nt.V @ t.bias)

    @property
    def n_expert(self) -> int:
        return int(next(iter(self.routers.values())).shape[0])

    @property
    def n_embd(self) -> int:
        return int(next(iter(self.routers.values())).shape[1])

    def next_layer(self, layer: int) -> int | None:
        return self._next.get(layer)

    def rollout_logits(self, layer: int, hidden: npt.ArrayLike, depth: int) -> list[tuple[int, F32]]:
        """Predicted router logits of the next `depth` MoE layers (fewer where the model
        ends). hidden is [n_embd] or [n, n_embd]; logits are [..., n_expert]."""
        out: list[tuple[int, F32]] = []
        il = layer
        t = self.transitions.get(il)
        if depth <= 0 or t is None:
            return out
        z: F32 = np.asarray(hidden, dtype=np.float32) @ t.V.T
        for step in range(depth):
            m = self._next.get(il)
            if m is None:
                break
            out.append((m, z @ self._G[il].T + self._g[il]))
            if step + 1 == depth or il not in self._S:
                break
            z = z @ self._S[il].T + self._s[il]
            il = m
        return out

    def rollout(self, layer: int, hidden: npt.ArrayLike, depth: int) -> list[tuple[int, F32]]:
        """[(layer, probs [n_expert])] for the next `depth` MoE layers after `layer`."""
        return [(m, gate_probs(lg, self.gating)) for m, lg in self.rollout_logits(layer, hidden, depth)]

    def baseline(self, layer: int, hidden: npt.ArrayLike, depth: int) -> list[tuple[int, F32]]:
        """Cross-layer baseline: the router of each later MoE layer applied to this layer's input."""
        x = np.asarray(hidden, dtype=np.float32)
        out: list[tuple[int, F32]] = []
        il = layer
        for _ in range(depth):
            m = self._following(il)
            if m is None:
                break
            out.append((m, gate_probs(x @ self.routers[m].T, self.gating)))
            il = m
        return out

    def _following(self, layer: int) -> int | None:
        for il in self.moe_layers:
            if il > layer:
                return il
        return None

    @staticmethod
    def confidence(probs: npt.ArrayLike, k: int) -> float:
        """Probability mass of the predicted top-k (probabilities renormalized to sum 1)."""
        p = np.asarray(probs, dtype=np.float32)
        if k >= p.shape[-1]:
            return 1.0
        top = np.partition(p, p.shape[-1] - k)[p.shape[-1] - k :]
        total = float(p.sum())
        return float(top.sum()) / total if total > 0 else 0.0

    def nbytes(self) -> int:
        return sum(t.U.nbytes + t.V.nbytes + t.bias.nbytes for t in self.transitions.values())
