"""The whole calibration: capture -> fit transitions and LoRE surrogates layer by layer -> sidecar.

Fitting holds two consecutive MoE layers' trace rows (float16 on disk, float32
while fitting: about tokens x n_embd x 12 bytes per layer) and one expert's
dequantized weights at a time, so memory does not grow with the number of
layers. Each finished layer is saved under the work directory; a restarted
calibration skips the layers it already has.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.quants import dequantize
from tqdm import tqdm

from pyspice.calibrate.capture import CaptureConfig, capture
from pyspice.calibrate.lore_fit import LayerExperts, LoreConfig, fit_layer, heldout_mask, open_gguf
from pyspice.calibrate.predictor_fit import fit_transition
from pyspice.engine.decode_trace import ModelGeometry, model_geometry
from pyspice.formats.sidecar import LayerSurrogates, SidecarData, fingerprint, write_sidecar
from pyspice.outputs import atomic_output
from pyspice.policy.predictor import Transition, gate_probs, top_k

_FIT_VERSION = 2  # per-layer fit files of another version are refitted


@dataclass(frozen=True)
class CalibrateConfig:
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    lore: LoreConfig = field(default_factory=LoreConfig)
    draft_rank: int = 128
    draft_ridge: float = 1e-3
    draft_identity: bool = True
    draft_max_tokens: int = 16384


@dataclass
class LayerSummary:
    layer: int
    draft_r2: float  # held-out share of variance of the next MoE input explained
    recall_base: float  # held-out top-k recall one MoE layer ahead, cross-layer baseline
    recall_draft: float  # same, draft transition
    surrogate_error: float  # mean held-out relative error over experts with held-out tokens
    error_by_rank: dict[int, float]
    shared_error: float
    expert_bytes: int
    surrogate_bytes: float  # mean per expert at the stored rank (f16)


@dataclass
class CalibrateResult:
    sidecar: Path
    tokens: int
    layers: list[LayerSummary] = field(default_factory=list)
    capture_s: float = 0.0
    fit_s: float = 0.0
    trace_bytes: int = 0
    sidecar_bytes: int = 0


def _recall(pred_probs: npt.NDArray[np.float32], true_ids: npt.NDArray[Any], k: int) -> float:
    pred = top_k(pred_probs, k)
    hits = (pred[:, :, None] == true_ids[:, None, :]).any(axis=2).sum()
    return float(hits) / float(true_ids.size) if true_ids.size else float("nan")


def _dir_bytes(path: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file()) if path.is_dir() else 0


def _save_layer(path: Path, arrays: dict[str, Any]) -> None:
    with atomic_output(path, ".tmp.npz") as tmp:
        np.savez(tmp, **arrays)


def calibrate(
    model_path: str | os.PathLike[str],
    text: str,
    sidecar_path: str | os.PathLike[str],
    work_dir: str | os.PathLike[str],
    config: CalibrateConfig | None = None,
    *,
    corpus: str = "",
    progress: bool = True,
) -> CalibrateResult:
    config = config or CalibrateConfig()
    model = Path(model_path)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    trace = capture(model, text, work / "trace", config.capture, corpus=corpus, progress=progress)
    t1 = time.perf_counter()
    geo = model_geometry(model)
    reader = open_gguf(model)
    routers = _routers(reader, geo)
    fit_dir = work / "fit"
    fit_dir.mkdir(exist_ok=True)
    T = trace.n_tokens
    held = heldout_mask(T, config.lore.heldout_every)
    train_rows = np.flatnonzero(~held)
    if len(train_rows) > config.draft_max_tokens:
        train_rows = train_rows[:: int(np.ceil(len(train_rows) / config.draft_max_tokens))]
    test_rows = np.flatnonzero(held)
    k = geo.n_expert_used
    layers = geo.moe_layers
    summaries: list[LayerSummary] = []
    transitions: dict[int, Transition] = {}
    surrogates: dict[int, LayerSurrogates] = {}
    fields = ("hidden", "ids", "shared") if geo.has_shared else ("hidden", "ids")
    current: dict[str, np.ndarray] | None = None
    bar = tqdm(total=len(layers), unit="layer", desc="fit", disable=not progress, file=sys.stderr)
    for j, il in enumerate(layers):
        done = fit_dir / f"L{il:04d}.npz"
        nxt = layers[j + 1] if j + 1 < len(layers) else None
        saved = {}
        if done.exists():
            with np.load(done) as z:
                saved = {key: z[key] for key in z.files}
            if int(saved.get("fit_version", 0)) != _FIT_VERSION:
                saved = {}  # made by another version of the fit: redo it
            current = None
        if not saved:
            if current is None:
                current = trace.layer(il, fields)
            following = trace.layer(nxt, fields) if nxt is not None else None
            saved = _fit_one(il, nxt, current, following, reader, routers, geo, train_rows, test_rows, config)
            _save_layer(done, saved)
            current = following
        if "draft_u" in saved:
            transitions[il] = Transition(
                saved["draft_u"], saved["draft_v"], saved["draft_bias"], float(saved["draft_scale"])
            )
        surrogates[il] = LayerSurrogates(
            A=saved["lore_a"],
            B=saved["lore_b"],
            alpha=saved["lore_alpha"],
            rank=saved["lore_rank"],
            error=saved["lore_error"],
            error_shared=saved["lore_error_shared"],
            error_drop=saved["lore_error_drop"],
            count=saved.get("lore_count"),
        )
        summaries.append(_summary(il, saved, k))
        bar.update(1)
    bar.close()
    data = SidecarData(
        model=model.name,
        fingerprint=fingerprint(model),
        moe_layers=list(layers),
        n_embd=geo.n_embd,
        n_expert=geo.n_expert,
        n_expert_used=k,
        gating=geo.gating,
        corpus=corpus,
        tokens=T,
        draft_rank=config.draft_rank,
        lore_rank=config.lore.rank,
        has_shared=geo.has_shared,
        transitions=transitions,
        surrogates=surrogates,
    )
    out = write_sidecar(sidecar_path, data)
    t2 = time.perf_counter()
    return CalibrateResult(
        sidecar=out,
        tokens=T,
        layers=summaries,
        capture_s=t1 - t0,
        fit_s=t2 - t1,
        trace_bytes=_dir_bytes(work / "trace"),
        sidecar_bytes=out.stat().st_size,
    )


def _routers(reader: Any, geo: ModelGeometry) -> dict[int, npt.NDArray[np.float32]]:
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for il in geo.moe_layers:
        t = tensors[f"blk.{il}.ffn_gate_inp.weight"]
        w = dequantize(t.data, t.tensor_type)
        out[il] = np.ascontiguousarray(np.asarray(w, dtype=np.float32).reshape(geo.n_expert, geo.n_embd))
    return out


def _fit_one(
    il: int,
    nxt: int | None,
    cur: dict[str, np.ndarray],
    following: dict[str, np.ndarray] | None,
    reader: Any,
    routers: dict[int, npt.NDArray[np.float32]],
    geo: ModelGeometry,
    train_rows: npt.NDArray[np.intp],
    test_rows: npt.NDArray[np.intp],
    config: CalibrateConfig,
) -> dict[str, Any]:
    k = geo.n_expert_used
    saved: dict[str, Any] = {"fit_version": np.int64(_FIT_VERSION)}
    H = cur["hidden"]
    if nxt is not None and following is not None:
        Hn = following["hidden"]
        t = fit_transition(
            H[train_rows].astype(np.float32),
            Hn[train_rows].astype(np.float32),
            config.draft_rank,
            config.draft_ridge,
            identity=config.draft_identity,
        )
        saved.update(draft_u=t.U, draft_v=t.V, draft_bias=t.bias, draft_scale=np.float64(t.scale))
        Xt = H[test_rows].astype(np.float32)
        Yt = Hn[test_rows].astype(np.float64)
        pred = t.apply(Xt).astype(np.float64)
        ss_tot = float(((Yt - Yt.mean(axis=0)) ** 2).sum())
        saved["draft_r2"] = np.float64(1.0 - float(((Yt - pred) ** 2).sum()) / ss_tot if ss_tot else 0.0)
        true_ids = following["ids"][test_rows]
        w = routers[nxt]
        saved["recall_base"] = np.float64(_recall(gate_probs(Xt @ w.T, geo.gating), true_ids, k))
        saved["recall_draft"] = np.float64(
            _recall(gate_probs(pred.astype(np.float32) @ w.T, geo.gating), true_ids, k)
        )
    experts = LayerExperts(reader, il)
    fit = fit_layer(experts, H, cur["ids"], cur.get("shared"), config.lore)
    R = config.lore.rank
    E, d = experts.n_expert, experts.n_embd
    A = np.zeros((E, R, d), np.float32)
    B = np.zeros((E, d, R), np.float32)
    for e, f in enumerate(fit.experts):
        r = f.A.shape[0]
        A[e, :r] = f.A
        B[e, :, :r] = f.B
    report = sorted({R, *config.lore.report_ranks})
    saved.update(
        lore_a=A,
        lore_b=B,
        lore_alpha=np.array([f.alpha for f in fit.experts], np.float32),
        lore_rank=np.array([f.A.shape[0] for f in fit.experts], np.int32),
        lore_error=np.array([f.error for f in fit.experts], np.float32),
        lore_error_shared=np.array([f.error_shared for f in fit.experts], np.float32),
        lore_error_drop=np.array([f.error_drop for f in fit.experts], np.float32),
        lore_report_ranks=np.array(report, np.int32),
        lore_error_by_rank=np.array(
            [[f.error_by_rank.get(r, np.nan) for r in report] for f in fit.experts], np.float32
        ),
        lore_n_train=np.array([f.n_train for f in fit.experts], np.int32),
        lore_count=np.bincount(cur["ids"].reshape(-1).astype(np.int64), minlength=E).astype(np.int64),
        expert_bytes=np.int64(fit.expert_bytes),
    )
    return saved


def _nanmean(a: npt.ArrayLike) -> float:
    x = np.asarray(a, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else float("nan")


def _summary(il: int, saved: dict[str, Any], k: int) -> LayerSummary:
    ranks = [int(r) for r in saved["lore_report_ranks"]]
    by_rank = {r: _nanmean(saved["lore_error_by_rank"][:, i]) for i, r in enumerate(ranks)}
    d = saved["lore_a"].shape[2]
    return LayerSummary(
        layer=il,
        draft_r2=float(saved.get("draft_r2", np.nan)),
        recall_base=float(saved.get("recall_base", np.nan)),
        recall_draft=float(saved.get("recall_draft", np.nan)),
        surrogate_error=_nanmean(saved["lore_error"]),
        error_by_rank=by_rank,
        shared_error=_nanmean(saved["lore_error_shared"]),
        expert_bytes=int(saved["expert_bytes"]),
        surrogate_bytes=float(saved["lore_rank"].mean()) * 2 * d * 2 + 4,
    )
