"""The routing regime of a trace: how much an expert cache can gain from it.

Figures over the expert ids of every (token, MoE layer) of a trace, full or
ids-only (`TraceReader.routing()`), read as one decode stream: token by token
in trace order, sequences one after another, every MoE layer its own cache of
`slots` experts (a share of the layer's experts, BUDGETS):

- popularity skew: per layer, the share of the layer's activations carried by
  its most used 25% and 50% of experts, averaged over layers (a uniform router
  gives 0.25 and 0.50);
- reuse distance: per activation, tokens since the same layer last selected
  the expert (a first use has none), as bucketed shares and quantiles;
- LRU hit: the share of activations whose expert is resident in a
  least-recently-used cache when its token comes. A token's experts are
  looked up together, then all become the most recent, the row's first (the
  router's top choice, as the trace stores rows) most recent of all; so with
  fewer slots than the token has experts, the cache keeps the row's first.
  Beside it the serial LRU, the row's experts looked up one after another (a
  token's own miss may then evict an expert it needs later in the row);
- MIN hit: Belady's offline optimum for the same demand-loading caches (every
  expert a token uses enters the cache; a miss evicts the one used again
  farthest ahead), as `pyspice.sim.belady` counts it per layer: no
  replacement policy hits more. Beside it MIN with bypass, where a miss may
  run without entering the cache (belady.read_bound's rule): the most hits
  of any policy, caching or not;
- cross-layer co-occurrence recall: layer l's ids predict layer l+1's top-k
  by a table of P(expert e' at l+1 | expert e at l) fitted on the first 80%
  of the sequences (one sequence: of the tokens), each candidate scored by
  the sum over the token's layer-l experts; recall@k on the rest, averaged
  over tokens and layer pairs. Beside it, the same recall for predicting
  layer l+1's most used experts of the fitting part (popularity alone), and
  k / n_expert (a random guess).

`read_routing` reads a trace directory, or a folder of traces of one model
(each trace one or more sequences of the whole, in natural name order: a
`generate --trace` run per prompt).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pyspice.formats.trace import TraceError, TraceReader

# cache sizes as shares of one layer's experts, with the labels the JSON keys use
BUDGETS: tuple[tuple[str, float], ...] = (("12.5%", 0.125), ("25%", 0.25), ("50%", 0.5))
# reuse distance buckets in tokens: (lowest, highest or None, label)
REUSE_BUCKETS: tuple[tuple[int, int | None, str], ...] = (
    (1, 1, "1"),
    (2, 4, "2-4"),
    (5, 16, "5-16"),
    (17, 64, "17-64"),
    (65, None, ">64"),
)
REUSE_QUANTILES: tuple[tuple[str, float], ...] = (("p25", 0.25), ("p50", 0.5), ("p75", 0.75), ("p90", 0.9))
TOP_SHARES: tuple[float, ...] = (0.25, 0.5)
FIT_SHARE = 0.8  # the co-occurrence table is fitted on this share of the sequences
_NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Routing:
    """A trace's expert ids as one stream: ids[t, j] are token t's experts at MoE layer j."""

    name: str
    model: str
    source: str
    kind: str  # "full" or "ids-only"
    ids: npt.NDArray[np.int32]  # [tokens, MoE layers, k]
    sequences: tuple[tuple[int, int], ...]  # (start, stop) token ranges, in order, covering ids
    n_expert: int
    moe_layers: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    def first_sequences(self, n: int) -> Routing:
        """The stream cut after its first n sequences (all of them when it has fewer)."""
        kept = self.sequences[: max(1, n)]
        return replace(self, ids=self.ids[: kept[-1][1]], sequences=kept)


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _reader_routing(reader: TraceReader) -> tuple[npt.NDArray[np.int32], list[tuple[int, int]]]:
    if reader.n_tokens == 0:
        raise TraceError(f"{reader.path} holds no tokens: record or import it again")
    ids, _weights = reader.routing()
    return ids, reader.sequences()


def read_routing(path: str | Path) -> Routing:
    """The routing of a trace directory, or of a folder of traces of one model (its
    sub-folders that hold a meta.json, in natural order, each adding its sequences)."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"{path} is not a folder: give a trace directory (or a folder of traces)")
    if (path / "meta.json").exists():
        readers = [TraceReader(path)]
    else:
        parts = sorted((p for p in path.iterdir() if (p / "meta.json").is_file()), key=_natural_key)
        if not parts:
            raise TraceError(
                f"{path} is neither a trace (no meta.json) nor a folder of traces: record one with "
                "`pyspice generate --trace DIR` or import one with `pyspice trace import`"
            )
        readers = [TraceReader(p) for p in parts]
    first = readers[0].meta
    chunks: list[npt.NDArray[np.int32]] = []
    sequences: list[tuple[int, int]] = []
    offset = 0
    for reader in readers:
        meta = reader.meta
        same = (meta.model, meta.moe_layers, meta.n_expert, meta.n_expert_used)
        if same != (first.model, first.moe_layers, first.n_expert, first.n_expert_used):
            raise TraceError(
                f"{reader.path} is of another model or geometry than {readers[0].path} "
                f"({meta.model}: {len(meta.moe_layers)} MoE layers, {meta.n_expert} experts, "
                f"top-{meta.n_expert_used}; {first.model}: {len(first.moe_layers)}, {first.n_expert}, "
                f"top-{first.n_expert_used}): "
                "a folder of traces holds one model's"
            )
        ids, seqs = _reader_routing(reader)
        _check_rows(ids, reader.path, meta.moe_layers)
        chunks.append(ids)
        sequences.extend((a + offset, b + offset) for a, b in seqs)
        offset += ids.shape[0]
    return Routing(
        name=path.name,
        model=first.model,
        source=first.source,
        kind=first.kind,
        ids=np.concatenate(chunks, axis=0),
        sequences=tuple(sequences),
        n_expert=first.n_expert,
        moe_layers=tuple(first.moe_layers),
    )


def _check_rows(ids: npt.NDArray[np.int32], path: Path, moe_layers: list[int]) -> None:
    """A row that selects one expert twice is not a router's top-k: name the first."""
    if ids.shape[2] < 2:
        return
    ordered = np.sort(ids, axis=2)
    twice = np.argwhere((ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2))
    if len(twice):
        t, j = (int(v) for v in twice[0])
        raise TraceError(
            f"{path}: token {t} of layer {moe_layers[j]} selects one expert twice "
            f"({ids[t, j].tolist()}); a damaged trace: record or import it again"
        )


def slots_of(n_expert: int, share: float) -> int:
    """A layer's cache size at `share` of its experts (nearest whole expert, at least one)."""
    return max(1, math.floor(share * n_expert + 0.5))


# ---- popularity ---------------------------------------------------------------------


def popularity_curve(routing: Routing) -> npt.NDArray[np.float64]:
    """[n_expert + 1]: the share of a layer's activations carried by its i most used
    experts, averaged over layers (0 at i = 0, 1 at i = n_expert)."""
    curves = []
    for j in range(routing.n_layers):
        counts = np.bincount(routing.ids[:, j].ravel(), minlength=routing.n_expert).astype(np.float64)
        ordered = np.sort(counts)[::-1]
        curves.append(np.concatenate(([0.0], np.cumsum(ordered) / max(1.0, ordered.sum()))))
    return np.asarray(np.mean(curves, axis=0), dtype=np.float64)


# ---- reuse ---------------------------------------------------------------------------


def reuse_links(ids: npt.NDArray[np.int32]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(distance, next use), both [T, L, k]: tokens since the same layer last selected
    the activation's expert (0 for a first use), and the next token that selects it
    (_NEVER when none does). Rows select distinct experts (read_routing checks)."""
    T, L, k = ids.shape
    distance = np.zeros((T, L, k), dtype=np.int64)
    next_use = np.full((T, L, k), _NEVER, dtype=np.int64)
    tokens = np.repeat(np.arange(T, dtype=np.int64), k)
    for j in range(L):
        experts = ids[:, j].ravel()
        order = np.lexsort((tokens, experts))  # by expert, then token
        e, t = experts[order], tokens[order]
        same = e[1:] == e[:-1]
        dist = np.zeros(T * k, dtype=np.int64)
        dist[order[1:][same]] = (t[1:] - t[:-1])[same]
        nxt = np.full(T * k, _NEVER, dtype=np.int64)
        nxt[order[:-1][same]] = t[1:][same]
        distance[:, j] = dist.reshape(T, k)
        next_use[:, j] = nxt.reshape(T, k)
    return distance, next_use


# ---- caches --------------------------------------------------------------------------


def lru_depths(
    ids: npt.NDArray[np.int32], n_expert: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(per token, serial), both [T, L, k]: per activation, how many of the layer's experts
    stand above it in an LRU stack when it is looked up (_NEVER at a first use); an LRU
    cache of C slots hits exactly the activations of depth < C.

    per token: a token's experts are looked up together, then all become the most
    recent, the row's first the most recent of all (a cache that never evicts what the
    token needs, as a hook call sees its experts). serial: the row's experts are looked
    up one after another, each moved to the top before the next is looked up, so a
    token's own miss can push out an expert it needs later in the row (a cache keyed by
    activation)."""
    T, L, k = ids.shape
    rows = np.arange(L)[:, None]
    positions = np.arange(k, dtype=np.int64)[None, :]
    # last use as token * k + a position: reversed for per token (row's first newest), in order for serial
    stamp = np.full((L, n_expert), -1, dtype=np.int64)
    serial_stamp = np.full((L, n_expert), -1, dtype=np.int64)
    earlier = np.tril(np.ones((k, k), dtype=bool), -1)  # earlier[j, i]: position i comes before j
    depths = np.empty((T, L, k), dtype=np.int64)
    serial = np.empty((T, L, k), dtype=np.int64)
    for t in range(T):
        need = ids[t]
        mine = stamp[rows, need]  # [L, k]
        depths[t] = np.where(mine >= 0, (stamp[:, :, None] > mine[:, None, :]).sum(axis=1), _NEVER)
        stamp[rows, need] = t * k + (k - 1 - positions)
        mine = serial_stamp[rows, need]
        above = (serial_stamp[:, :, None] > mine[:, None, :]).sum(axis=1)
        # the row's earlier experts that stood below this one (or were absent) now stand above it
        pushed = ((mine[:, None, :] < mine[:, :, None]) & earlier[None]).sum(axis=2)
        serial[t] = np.where(mine >= 0, above + pushed, _NEVER)
        serial_stamp[rows, need] = t * k + positions
    return depths, serial


def min_hits(
    ids: npt.NDArray[np.int32],
    next_use: npt.NDArray[np.int64],
    n_expert: int,
    slots: int,
    *,
    bypass: bool = False,
) -> npt.NDArray[np.int64]:
    """[L]: hits of Belady's MIN, one cache of `slots` experts per layer.

    Demand loading (bypass=False, the classic MIN, `pyspice.sim.belady`'s per-layer
    row): a token's experts all enter the cache, and a miss evicts the expert used
    again farthest ahead, never one the token needs. After each token a layer keeps
    the token's experts, then those it held whose next use is soonest (dropping one
    never used again early changes no hit). With fewer slots than the token has
    experts, it keeps those of the token used again soonest: a rule, not an optimum.

    With bypass (`belady.read_bound`'s MIN): a miss may run without entering the
    cache; after each token a layer keeps the `slots` experts, of those it held and
    those the token used, whose next use is soonest: the most hits any policy has."""
    T, L, _k = ids.shape
    held = np.zeros((L, n_expert), dtype=bool)
    upcoming = np.full((L, n_expert), _NEVER, dtype=np.int64)
    rows = np.arange(L)[:, None]
    hits = np.zeros(L, dtype=np.int64)
    keep = min(slots, n_expert)
    for t in range(T):
        need = ids[t]
        hits += held[rows, need].sum(axis=1)
        upcoming[rows, need] = next_use[t]
        held[rows, need] = True
        key = np.where(held, upcoming, _NEVER)
        if not bypass:
            # the token's experts stay, each holding its slot through the token even when never
            # used again (key T at most); the others' keys move past every next use
            key = np.where(key != _NEVER, key + T + 1, key)
            key[rows, need] = np.minimum(next_use[t], T)
        if keep < n_expert:
            chosen = np.argpartition(key, keep - 1, axis=1)[:, :keep]
            held[:] = False
            held[rows, chosen] = True
        held &= key != _NEVER
    return hits


# ---- cross-layer co-occurrence -------------------------------------------------------


def _one_hot(ids: npt.NDArray[np.int32], n_expert: int) -> npt.NDArray[np.float64]:
    """[T, n_expert]: 1 where the token selected the expert."""
    out = np.zeros((ids.shape[0], n_expert), dtype=np.float64)
    np.put_along_axis(out, ids.astype(np.int64), 1.0, axis=1)
    return out


def _recall(scores: npt.NDArray[np.float64], actual: npt.NDArray[np.float64], k: int) -> float:
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    return float(np.take_along_axis(actual, top, axis=1).sum(axis=1).mean() / k)


@dataclass(frozen=True)
class CooccurrenceSplit:
    fit_sequences: int
    test_sequences: int
    fit_tokens: int
    test_tokens: int


def cooccurrence_split(routing: Routing) -> CooccurrenceSplit:
    """The first FIT_SHARE of the sequences fit, the rest test (one sequence: its tokens)."""
    n = len(routing.sequences)
    if n >= 2:
        fit = min(n - 1, max(1, math.floor(FIT_SHARE * n)))
        cut = routing.sequences[fit][0]
        return CooccurrenceSplit(fit, n - fit, cut, routing.n_tokens - cut)
    cut = min(routing.n_tokens - 1, max(1, math.floor(FIT_SHARE * routing.n_tokens)))
    return CooccurrenceSplit(1, 1, cut, routing.n_tokens - cut)


def cooccurrence_recall(routing: Routing, split: CooccurrenceSplit) -> tuple[float, float]:
    """(co-occurrence recall@k, popularity recall@k) over layer pairs (l, l+1), on the
    test tokens, both fitted on the fitting tokens."""
    if routing.n_layers < 2 or split.fit_tokens < 1 or split.test_tokens < 1:
        return float("nan"), float("nan")
    cut, k, E = split.fit_tokens, routing.k, routing.n_expert
    hot = [_one_hot(routing.ids[:, j], E) for j in range(routing.n_layers)]
    cooc, popular = [], []
    for j in range(routing.n_layers - 1):
        here, there = hot[j], hot[j + 1]
        table = here[:cut].T @ there[:cut]  # [E, E]: tokens with e at l and e' at l+1
        conditional = table / np.maximum(here[:cut].sum(axis=0), 1.0)[:, None]
        actual = there[cut:]
        cooc.append(_recall(here[cut:] @ conditional, actual, k))
        counts = there[:cut].sum(axis=0)
        popular.append(_recall(np.broadcast_to(counts, actual.shape), actual, k))
    return float(np.mean(cooc)), float(np.mean(popular))


# ---- all figures ---------------------------------------------------------------------


@dataclass(frozen=True)
class Regime:
    """A trace's figures (`to_dict` is what `pyspice trace stats --json` prints)."""

    name: str
    model: str
    source: str
    kind: str
    layers: int
    experts: int
    k: int
    tokens: int
    sequences: int
    top_shares: dict[str, float]  # "25%" -> share carried by the most used 25% of experts
    uniform_shares: dict[str, float]  # the same for a uniform router
    popularity_curve: list[float]
    reuse_shares: dict[str, float]  # bucket label -> share of all activations; "first" = first uses
    reuse_quantiles: dict[str, float]  # over reuses (first uses left out), in tokens
    slots: dict[str, int]
    lru_hit: dict[str, float]
    min_hit: dict[str, float]
    lru_serial_hit: dict[str, float]
    min_bypass_hit: dict[str, float]
    lru_hit_per_layer: dict[str, list[float]]
    min_hit_per_layer: dict[str, list[float]]
    cooc_recall: float
    popular_recall: float
    random_recall: float
    split: CooccurrenceSplit
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        def r(x: float) -> float | None:
            return None if math.isnan(x) else round(float(x), 4)

        return {
            "trace": self.name,
            "model": self.model,
            "source": self.source,
            "kind": self.kind,
            "layers": self.layers,
            "experts": self.experts,
            "k": self.k,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "top25_share": r(self.top_shares["25%"]),
            "top50_share": r(self.top_shares["50%"]),
            "uniform_top25_share": r(self.uniform_shares["25%"]),
            "uniform_top50_share": r(self.uniform_shares["50%"]),
            "popularity_curve": [r(v) for v in self.popularity_curve],
            "reuse_distance": {
                "shares": {key: r(v) for key, v in self.reuse_shares.items()},
                "quantiles": {key: r(v) for key, v in self.reuse_quantiles.items()},
            },
            "slots": dict(self.slots),
            "lru_hit": {key: r(v) for key, v in self.lru_hit.items()},
            "min_hit": {key: r(v) for key, v in self.min_hit.items()},
            "lru_serial_hit": {key: r(v) for key, v in self.lru_serial_hit.items()},
            "min_bypass_hit": {key: r(v) for key, v in self.min_bypass_hit.items()},
            "lru_hit_per_layer": {key: [r(v) for v in vs] for key, vs in self.lru_hit_per_layer.items()},
            "min_hit_per_layer": {key: [r(v) for v in vs] for key, vs in self.min_hit_per_layer.items()},
            "cooc_recall": r(self.cooc_recall),
            "popular_recall": r(self.popular_recall),
            "random_recall": r(self.random_recall),
            "cooc_split": {
                "fit_sequences": self.split.fit_sequences,
                "test_sequences": self.split.test_sequences,
                "fit_tokens": self.split.fit_tokens,
                "test_tokens": self.split.test_tokens,
            },
            "notes": list(self.notes),
        }


def _share_label(share: float) -> str:
    return f"{share * 100:g}%"


def regime(routing: Routing) -> Regime:
    """Every figure of the module docstring for one routing stream."""
    ids, E, k = routing.ids, routing.n_expert, routing.k
    T, L = routing.n_tokens, routing.n_layers
    activations = T * k  # per layer
    notes = []
    curve = popularity_curve(routing)
    top_shares, uniform = {}, {}
    for share in TOP_SHARES:
        n_top = slots_of(E, share)
        top_shares[_share_label(share)] = float(curve[n_top])
        uniform[_share_label(share)] = n_top / E

    distance, next_use = reuse_links(ids)
    reused = distance[distance > 0]
    total = distance.size
    reuse_shares = {}
    for low, high, label in REUSE_BUCKETS:
        inside = (reused >= low) if high is None else ((reused >= low) & (reused <= high))
        reuse_shares[label] = float(inside.sum() / total)
    reuse_shares["first"] = float((distance == 0).sum() / total)
    quantiles = {
        label: (float(np.quantile(reused, q)) if reused.size else float("nan"))
        for label, q in REUSE_QUANTILES
    }

    depths, serial_depths = lru_depths(ids, E)
    slots: dict[str, int] = {}
    lru: dict[str, float] = {}
    mins: dict[str, float] = {}
    lru_serial: dict[str, float] = {}
    min_bypass: dict[str, float] = {}
    lru_layer: dict[str, list[float]] = {}
    min_layer: dict[str, list[float]] = {}
    for label, share in BUDGETS:
        c = slots_of(E, share)
        slots[label] = c
        per_layer_lru = (depths < c).sum(axis=(0, 2)) / activations
        per_layer_min = min_hits(ids, next_use, E, c) / activations
        lru_layer[label] = per_layer_lru.tolist()
        min_layer[label] = per_layer_min.tolist()
        lru[label] = float(per_layer_lru.mean())
        mins[label] = float(per_layer_min.mean())
        lru_serial[label] = float((serial_depths < c).mean())
        min_bypass[label] = float(min_hits(ids, next_use, E, c, bypass=True).mean() / activations)
        if c < k:
            notes.append(
                f"at {label} a layer's cache ({c} slots) is smaller than a token's {k} experts: LRU keeps "
                "each row's first, MIN those of the token used again soonest (a rule, not an optimum)"
            )
    split = cooccurrence_split(routing)
    cooc, popular = cooccurrence_recall(routing, split)
    if L < 2:
        notes.append("one MoE layer: no cross-layer recall")
    if len(routing.sequences) < 2:
        notes.append("one sequence: the co-occurrence table is fitted on its first 80% of tokens")
    return Regime(
        name=routing.name,
        model=routing.model,
        source=routing.source,
        kind=routing.kind,
        layers=L,
        experts=E,
        k=k,
        tokens=T,
        sequences=len(routing.sequences),
        top_shares=top_shares,
        uniform_shares=uniform,
        popularity_curve=curve.tolist(),
        reuse_shares=reuse_shares,
        reuse_quantiles=quantiles,
        slots=slots,
        lru_hit=lru,
        min_hit=mins,
        lru_serial_hit=lru_serial,
        min_bypass_hit=min_bypass,
        lru_hit_per_layer=lru_layer,
        min_hit_per_layer=min_layer,
        cooc_recall=cooc,
        popular_recall=popular,
        random_recall=k / E,
        split=split,
        notes=notes,
    )
