"""The routing regime of a trace: hand-computed caches, skew and reuse on tiny traces,
MIN against an exhaustive optimum, LRU against a plain OrderedDict cache, and a planted
cross-layer rule that co-occurrence recall finds whole."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from pyspice.cli import trace_stats_cmd
from pyspice.formats.trace import TraceError, TraceMeta, TraceWriter
from pyspice.sim.regime import lru_depths, min_hits, read_routing, regime, reuse_links, slots_of


def write_trace(
    path: Path,
    ids: np.ndarray,
    n_expert: int,
    *,
    starts: list[int] | None = None,
    model: str = "m",
    full: bool = False,
) -> Path:
    """ids [T, L, k] as a trace: ids-only, or full (hidden, probs and weights too)."""
    T, L, k = ids.shape
    layers = list(range(1, L + 1))
    meta = TraceMeta(
        model=model,
        fingerprint="",
        n_layers=L + 1,
        moe_layers=layers,
        n_expert=n_expert,
        n_expert_used=k,
        n_embd=2 if full else 0,
        fields=["hidden", "probs", "ids", "weights"] if full else ["ids"],
        source="decode" if full else "imported",
        hidden_rows=full,
        sequence_starts=starts or [],
    )
    with TraceWriter(path, meta, chunk_tokens=4) as w:
        for j, il in enumerate(layers):
            fields: dict[str, np.ndarray] = {"ids": ids[:, j]}
            if full:
                fields |= {
                    "hidden": np.zeros((T, 2)),
                    "probs": np.full((T, n_expert), 1 / n_expert),
                    "weights": np.full((T, k), 1 / k),
                }
            w.add(il, 0, **fields)
    return path


# one layer of 8 experts, top-1: 0 1 2 0 1 2 0 3 0
STREAM = [0, 1, 2, 0, 1, 2, 0, 3, 0]


def tiny(tmp_path: Path, full: bool = False) -> Path:
    ids = np.array(STREAM, dtype=np.int32).reshape(-1, 1, 1)
    return write_trace(tmp_path / "tiny", ids, 8, full=full)


@pytest.mark.parametrize("full", [False, True])
def test_hand_computed_figures_of_a_tiny_trace(tmp_path: Path, full: bool) -> None:
    r = regime(read_routing(tiny(tmp_path, full)))
    assert (r.layers, r.experts, r.k, r.tokens, r.sequences) == (1, 8, 1, 9, 1)
    assert r.kind == ("full" if full else "ids-only")
    assert r.slots == {"12.5%": 1, "25%": 2, "50%": 4}
    # LRU of 2: only the last 0 finds itself resident (after 0 3); of 4 every reuse hits
    assert r.lru_hit == pytest.approx({"12.5%": 0, "25%": 1 / 9, "50%": 5 / 9})
    # MIN of 2: evict 1 at t2 (0 comes back first), 0 at t4; hits at t3, t5, t8
    assert r.min_hit == pytest.approx({"12.5%": 0, "25%": 3 / 9, "50%": 5 / 9})
    # with bypass one slot keeps 0 throughout (hits at t3, t6, t8); two keep 0 and 1 until t4
    assert r.min_bypass_hit == pytest.approx({"12.5%": 3 / 9, "25%": 4 / 9, "50%": 5 / 9})
    assert r.lru_serial_hit == r.lru_hit  # top-1: one lookup per token either way
    # counts 4, 2, 2, 1, 0, 0, 0, 0: the top 2 of 8 carry 6 of 9, the top 4 all
    assert r.top_shares == pytest.approx({"25%": 6 / 9, "50%": 1.0})
    assert r.uniform_shares == {"25%": 0.25, "50%": 0.5}
    # reuses at distance 3, 3, 3, 3 and 2; four first uses
    assert r.reuse_shares["2-4"] == pytest.approx(5 / 9)
    assert r.reuse_shares["first"] == pytest.approx(4 / 9)
    assert r.reuse_shares["1"] == 0 and r.reuse_shares["5-16"] == 0
    assert r.reuse_quantiles["p50"] == 3
    assert r.to_dict()["lru_hit"] == {"12.5%": 0.0, "25%": 0.1111, "50%": 0.5556}


def test_per_token_and_serial_lru_differ_by_hand() -> None:
    # rows [0 1], [2 0], [1 2] in a 2-slot cache
    ids = np.array([[0, 1], [2, 0], [1, 2]], dtype=np.int32).reshape(3, 1, 2)
    per_token, serial = lru_depths(ids, 8)
    # per token: 0 is the newest after t0, so t1 finds it; t1 leaves 2 and 0, so t2 finds 2
    assert ((per_token < 2).sum(), (serial < 2).sum()) == (2, 0)
    # serial: t1's miss on 2 pushes 0 to depth 2 before 0 is looked up
    assert serial[1, 0].tolist() == [np.iinfo(np.int64).max, 2]


def _ordered_dict_lru(ids: np.ndarray, slots: int, serial: bool) -> int:
    hits = 0
    for j in range(ids.shape[1]):
        cache: OrderedDict[int, None] = OrderedDict()
        for row in ids[:, j].tolist():
            if serial:
                for e in row:
                    hits += e in cache
                    cache[e] = None
                    cache.move_to_end(e)
                    while len(cache) > slots:
                        cache.popitem(last=False)
                continue
            hits += sum(e in cache for e in row)
            for e in reversed(row):  # the row's first ends the most recent
                cache[e] = None
                cache.move_to_end(e)
            while len(cache) > slots:
                cache.popitem(last=False)
    return hits


def random_ids(rng: np.random.Generator, T: int, L: int, E: int, k: int) -> np.ndarray:
    return np.array([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)], dtype=np.int32)


def test_lru_depths_match_a_plain_lru_cache() -> None:
    rng = np.random.default_rng(1)
    for _ in range(40):
        E, k = int(rng.integers(3, 10)), int(rng.integers(1, 4))
        k = min(k, E)
        ids = random_ids(rng, int(rng.integers(1, 30)), 2, E, k)
        per_token, serial = lru_depths(ids, E)
        for slots in range(1, E + 1):
            assert (per_token < slots).sum() == _ordered_dict_lru(ids, slots, serial=False)
            assert (serial < slots).sum() == _ordered_dict_lru(ids, slots, serial=True)


def _optimum(rows: list[tuple[int, ...]], slots: int, bypass: bool) -> int:
    """The most hits of any schedule, by exhaustive search over what the cache keeps."""

    @functools.cache
    def best(t: int, cache: frozenset[int]) -> int:
        if t == len(rows):
            return 0
        need = frozenset(rows[t])
        pool = cache | need
        if bypass:
            keeps = [frozenset(c) for c in itertools.combinations(sorted(pool), min(slots, len(pool)))]
        else:  # the token's experts are all in the cache during the token
            others = sorted(pool - need)
            room = min(slots - len(need), len(others))
            keeps = [need | frozenset(c) for c in itertools.combinations(others, room)]
        return len(need & cache) + max(best(t + 1, c) for c in keeps)

    return best(0, frozenset())


def test_min_is_the_optimum() -> None:
    rng = np.random.default_rng(2)
    for _ in range(150):
        E = int(rng.integers(3, 7))
        k = int(rng.integers(1, 3))
        ids = random_ids(rng, int(rng.integers(2, 10)), 1, E, k)
        _, next_use = reuse_links(ids)
        rows = [tuple(r) for r in ids[:, 0].tolist()]
        for slots in range(1, E + 1):
            got = int(min_hits(ids, next_use, E, slots, bypass=True)[0])
            assert got == _optimum(rows, slots, bypass=True), (rows, slots)
            if slots >= k:
                got = int(min_hits(ids, next_use, E, slots)[0])
                assert got == _optimum(rows, slots, bypass=False), (rows, slots)


def test_a_planted_cross_layer_rule_gives_recall_one(tmp_path: Path) -> None:
    # 16 experts in 4 blocks of 4 (top-4): layer 1 picks a block, layer 2 the next block
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 4, size=200)
    first = blocks[:, None] * 4 + np.arange(4)
    second = ((blocks[:, None] + 1) % 4) * 4 + np.arange(4)
    ids = np.stack([first, second], axis=1).astype(np.int32)
    path = write_trace(tmp_path / "planted", ids, 16, starts=list(range(0, 200, 20)))
    r = regime(read_routing(path))
    assert r.sequences == 10 and (r.split.fit_sequences, r.split.test_sequences) == (8, 2)
    assert r.split.test_tokens == 40
    assert r.cooc_recall == 1.0
    assert r.popular_recall < 0.6  # popularity alone names one block of four
    assert r.random_recall == 0.25


def test_a_folder_of_traces_is_one_stream_of_their_sequences(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    a, b = random_ids(rng, 6, 2, 8, 2), random_ids(rng, 5, 2, 8, 2)
    write_trace(tmp_path / "runs" / "p2", b, 8)
    write_trace(tmp_path / "runs" / "p10", rng.permuted(a, axis=2), 8, starts=[0, 3])
    write_trace(tmp_path / "runs" / "p1", a, 8)
    (tmp_path / "runs" / "p1.txt").write_text("the generated text\n")
    routing = read_routing(tmp_path / "runs")
    assert routing.name == "runs" and routing.n_tokens == 17
    assert routing.sequences == ((0, 6), (6, 11), (11, 14), (14, 17))  # p1, p2, p10 in natural order
    assert np.array_equal(routing.ids[6:11], b)
    assert routing.first_sequences(2).n_tokens == 11
    write_trace(tmp_path / "runs" / "p3", a, 8, model="another")
    with pytest.raises(TraceError, match="another model"):
        read_routing(tmp_path / "runs")


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="neither a trace"):
        read_routing(tmp_path / "empty")
    with pytest.raises(TraceError, match="not a folder"):
        read_routing(tmp_path / "missing")
    twice = np.array([[[1, 2]], [[3, 3]]], dtype=np.int32)
    write_trace(tmp_path / "twice", twice, 8)
    with pytest.raises(TraceError, match="token 1 of layer 1 selects one expert twice"):
        read_routing(tmp_path / "twice")


def test_slots_round_to_whole_experts() -> None:
    assert [slots_of(64, s) for s in (0.125, 0.25, 0.5)] == [8, 16, 32]
    assert [slots_of(60, s) for s in (0.125, 0.25, 0.5)] == [8, 15, 30]
    assert slots_of(4, 0.125) == 1


def _cli(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    trace_stats_cmd.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    assert args.func(args) == 0


def test_the_command_prints_json_a_table_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tiny(tmp_path)
    _cli(["stats", str(path), "--json"])
    one = json.loads(capsys.readouterr().out)
    for key in ("lru_hit", "min_hit", "top25_share", "cooc_recall"):
        assert key in one
    assert one["min_hit"]["25%"] == 0.3333 and one["cooc_recall"] is None  # one layer: no pair
    png = tmp_path / "regime.png"
    _cli(["stats", str(path), str(path), "--json", "--plot", str(png)])
    both = json.loads(capsys.readouterr().out)
    assert [t["trace"] for t in both["traces"]] == ["tiny", "tiny"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _cli(["stats", str(path)])
    table = capsys.readouterr().out
    assert "  LRU hit" in table and "0.111" in table and "tiny" in table.splitlines()[0]
