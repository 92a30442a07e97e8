"""The draft predictor: routing several MoE layers ahead (the paper's Algorithm 1).

Per MoE layer l, an affine transition predicts the next MoE layer's input
from this one, h' ≈ a_l h + c_l + U_l V_l h: a scaled identity (consecutive
MoE inputs are normalized views of one residual stream, so h' stays close to
h) plus a rank-r correction (U [n_embd, r], V [r, n_embd]). The target
model's own router of the next layer turns the predicted input into routing
probabilities; rolled out, each step feeds the previous prediction.

Everything before the final gating function is linear, so the rollout from
layer l to depth d is one matrix: G_{l,d} = W_{l+d} T_{l+d-1} ··· T_l (n_expert
x n_embd) and an offset g_{l,d}. They are composed once at construction
(recursively, G_{l,d} = a_l G_{l+1,d-1} + (G_{l+1,d-1} U_l) V_l, never forming
an n_embd² matrix) and stacked over depths, so a rollout of any depth up to
`max_depth` is one small matrix-vector product plus the gating function,
exactly equal to the step-by-step chain.

Router logits become probabilities as the architecture does it in llama.cpp's
build_moe_ffn: softmax for qwen2moe and for deepseek2 (V2 / V2-Lite; sigmoid
only for V3-style models whose GGUF says expert_gating_func = sigmoid).

Pure numpy: no native imports (the simulator uses the same object).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
GATINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Transition:
    """h_next ≈ scale·h + bias + U (V h) for one MoE layer."""

    U: F32  # [n_embd, r]
    V: F32  # [r, n_embd]
    bias: F32  # [n_embd]
    scale: float = 0.0

    @property
    def rank(self) -> int:
        return int(self.V.shape[0])

    def apply(self, h: npt.ArrayLike) -> F32:
        x = np.asarray(h, dtype=np.float32)
        return _f32(self.scale * x + (x @ self.V.T) @ self.U.T + self.bias)


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
    max_depth: the deepest rollout prepared (deeper requests are cut there).
    release: called with each transition once its maps are composed (a sidecar drops
        its pages from the resident set there, so the peak holds one layer's, not all).
    """

    def __init__(
        self,
        moe_layers: Sequence[int],
        routers: Mapping[int, npt.ArrayLike],
        transitions: Mapping[int, Transition],
        gating: str = "softmax",
        max_depth: int = 4,
        release: Callable[[Transition], None] | None = None,
    ) -> None:
        if gating not in GATINGS:
            raise ValueError(f"unknown gating {gating!r}; choose one of {GATINGS}")
        self.moe_layers = [int(il) for il in sorted(moe_layers)]
        self.gating = gating
        self.max_depth = max(1, int(max_depth))
        self.routers: Mapping[int, F32] = {il: _f32(routers[il]) for il in self.moe_layers}
        first = self.routers[self.moe_layers[0]] if self.moe_layers else np.zeros((0, 0), np.float32)
        self._n_expert, self._n_embd = int(first.shape[0]), int(first.shape[1])
        # kept as given (a sidecar's are f16 views of its file): they are needed only to
        # compose the maps below, which convert them a layer at a time
        self.transitions: dict[int, Transition] = dict(transitions)
        self._next: dict[int, int] = {
            a: b for a, b in zip(self.moe_layers, self.moe_layers[1:], strict=False) if a in self.transitions
        }
        # per source layer: the layers reached ([l+1, l+2, ...] while transitions last) and the
        # stacked composite maps [depth * n_expert, n_embd] with offsets [depth * n_expert]
        self._reach: dict[int, list[int]] = {}
        self._G: dict[int, F32] = {}
        self._g: dict[int, F32] = {}
        composite: dict[int, list[tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]] = {}
        for il in reversed(self.moe_layers):
            m = self._next.get(il)
            if m is None:
                continue
            t = self.transitions[il]
            U, V, c = (x.astype(np.float64) for x in (t.U, t.V, t.bias))
            maps: list[tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = []
            prev = [(self.routers[m].astype(np.float64), np.zeros(self.routers[m].shape[0]))]
            # the next layer's maps are needed only here: dropping them keeps one layer's
            # float64 maps alive at a time, not the whole model's (peak memory)
            prev += composite.pop(m, [])[: self.max_depth - 1]
            for G_next, g_next in prev:  # W_{..} T_{m..} composed once more with T_l
                maps.append((t.scale * G_next + (G_next @ U) @ V, G_next @ c + g_next))
            composite[il] = maps
            if release is not None:
                release(t)
            reach = [m]
            while len(reach) < len(maps):
                nxt = self._next.get(reach[-1])
                if nxt is None:
                    break
                reach.append(nxt)
            self._reach[il] = reach[: len(maps)]
            n = len(self._reach[il])
            self._G[il] = _f32(np.concatenate([G for G, _ in maps[:n]], axis=0))
            self._g[il] = _f32(np.concatenate([g for _, g in maps[:n]], axis=0))

    @property
    def n_expert(self) -> int:
        return self._n_expert

    @property
    def n_embd(self) -> int:
        return self._n_embd

    def drop_routers(self, source: Callable[[int], npt.ArrayLike | None]) -> None:
        """Let go of the routers once the maps are composed (a rollout reads only the
        maps); later reads of `routers` (the cross-layer baseline, evaluation) go to
        `source`. 2.2 MiB of float32 on smolmoe-b that a run under edge mode's memory
        limit would otherwise keep for nothing."""
        self.routers = _RoutersFrom(source, self.moe_layers)

    def _stacked_logits(self, layer: int, hidden: npt.ArrayLike, depth: int) -> tuple[list[int], F32]:
        """(layers reached, logits [..., n, n_expert]) in one product."""
        reach = self._reach.get(layer)
        if depth <= 0 or reach is None:
            return [], np.zeros((0, 0), np.float32)
        n = min(depth, len(reach))
        e = self.n_expert
        x = np.asarray(hidden, dtype=np.float32)
        logits = x @ self._G[layer][: n * e].T + self._g[layer][: n * e]
        return reach[:n], logits.reshape(*x.shape[:-1], n, e)

    def affine_map(self, layer: int, depth: int) -> tuple[list[int], F32, F32]:
        """The rollout as its affine map: (layers reached, G [n * n_expert, n_embd], g [n * n_expert])
        with logits = G h + g, layer by layer (views; the SPICE policy keeps them and applies
        them on its planning hook calls)."""
        reach = self._reach.get(layer)
        if depth <= 0 or reach is None:
            return [], np.zeros((0, 0), np.float32), np.zeros(0, np.float32)
        n = min(depth, len(reach))
        e = self.n_expert
        return reach[:n], self._G[layer][: n * e], self._g[layer][: n * e]

    def rollout_logits(self, layer: int, hidden: npt.ArrayLike, depth: int) -> list[tuple[int, F32]]:
        """Predicted router logits of the next `depth` MoE layers (fewer where the model
        ends or past max_depth). hidden is [n_embd] or [n, n_embd]; logits are [..., n_expert]."""
        reach, logits = self._stacked_logits(layer, hidden, depth)
        return [(m, logits[..., i, :]) for i, m in enumerate(reach)]

    def rollout(self, layer: int, hidden: npt.ArrayLike, depth: int) -> list[tuple[int, F32]]:
        """[(layer, probs [n_expert])] for the next `depth` MoE layers after `layer`."""
        reach, logits = self._stacked_logits(layer, hidden, depth)
        if not reach:
            return []
        probs = gate_probs(logits, self.gating)  # all depths at once: one call's overhead
        return [(m, probs[..., i, :]) for i, m in enumerate(reach)]

    def rollout_with_confidence(
        self, layer: int, hidden: npt.ArrayLike, depth: int, k: int
    ) -> list[tuple[int, F32, float]]:
        """rollout() plus each depth's confidence (mass of its top-k), computed for all depths at
        once; hidden must be one row [n_embd]."""
        reach, logits = self._stacked_logits(layer, hidden, depth)
        if not reach:
            return []
        probs = gate_probs(logits, self.gating)  # [n, n_expert]
        e = probs.shape[-1]
        if k >= e:
            conf = np.ones(len(reach), dtype=np.float32)
        else:
            conf = np.partition(probs, e - k, axis=-1)[:, e - k :].sum(axis=-1) / probs.sum(axis=-1)
        return [(m, probs[i], float(conf[i])) for i, m in enumerate(reach)]

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
        """Bytes of the prepared rollout maps (what a rollout reads)."""
        return sum(g.nbytes for g in self._G.values()) + sum(g.nbytes for g in self._g.values())


class _RoutersFrom(Mapping[int, F32]):
    """Routers read from their source on each access (DraftPredictor.drop_routers)."""

    def __init__(self, source: Callable[[int], npt.ArrayLike | None], layers: Sequence[int]) -> None:
        self._source = source
        self._layers = list(layers)

    def __getitem__(self, layer: int) -> F32:
        router = self._source(layer) if layer in self._layers else None
        if router is None:
            raise KeyError(layer)
        return _f32(router)

    def __iter__(self) -> Iterator[int]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)
