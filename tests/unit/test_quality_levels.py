"""The lossy levels' surrogates: the engine loads only those a level may use."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def test_the_engine_loads_only_the_surrogates_within_the_levels_error_limit() -> None:
    from pyspice.engine.surrogates import budget_rank, within_budget
    from pyspice.formats.sidecar import LayerSurrogates, Sidecar, SidecarData

    n_embd, n_expert, rank = 8, 4, 2
    rng = np.random.default_rng(0)
    layer = LayerSurrogates(
        A=rng.standard_normal((n_expert, rank, n_embd)).astype(np.float32),
        B=rng.standard_normal((n_expert, n_embd, rank)).astype(np.float32),
        alpha=np.ones(n_expert, np.float32),
        rank=np.full(n_expert, rank, np.int32),
        error=np.array([0.3, 0.5, np.nan, 0.9], np.float32),
        error_shared=np.full(n_expert, np.nan, np.float32),
        error_drop=np.ones(n_expert, np.float32),
    )
    data = SidecarData("m", "fp", [0], n_embd, n_expert, 2, lore_rank=rank, surrogates={0: layer})
    sidecar = Sidecar(data, path=Path("m.spice.gguf"), model_path=None)
    per_expert = rank * 2 * n_embd * 2 + 4
    source, cut = within_budget(sidecar, 10**9, 0.5)
    assert cut is None
    assert [source.surrogate(0, e) is not None for e in range(n_expert)] == [True, True, False, False]
    source, cut = within_budget(sidecar, 10**9)  # no limit: every fitted one, as before
    assert [source.surrogate(0, e) is not None for e in range(n_expert)] == [True, True, True, True]
    # the rank cut counts only the trusted ones: 2 of them fit a budget all 4 would not
    budget = int(2 * per_expert / 0.25)
    assert budget_rank(sidecar, budget, 0.5) is None and budget_rank(sidecar, budget) == 1
