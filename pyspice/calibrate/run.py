"""Calibration as a library: capture, fit and write a model's sidecar with the defaults
`pyspice calibrate` uses, keyed work directories, and the summary it prints.

This module runs the model (the capture), so it sits beside pyspice.measure in
the layering, above the engine; the fitting itself (lore_fit, predictor_fit)
is pure numpy.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from pyspice.calibrate.capture import CaptureConfig
from pyspice.calibrate.lore_fit import LoreConfig
from pyspice.calibrate.pipeline import CalibrateConfig, CalibrateResult, calibrate
from pyspice.formats.sidecar import (
    Sidecar,
    SidecarMismatchError,
    check_sidecar_output,
    default_sidecar_path,
    fingerprint,
)
from pyspice.models.builtin import builtin_of
from pyspice.models.smolmoe_recipe import RECIPE_NAME, text_or_corpus
from pyspice.paths import cache_dir

DEFAULT_CORPUS = "pydoc_data.topics:calibration"


def default_corpus_name(model: Path | None) -> str:
    """What a sidecar records as its corpus when calibrated on a built-in model's own text."""
    name = builtin_of(model)
    return DEFAULT_CORPUS if name in (None, RECIPE_NAME) else f"{name} mix:calibration"


def calibration_text(path: Path | None, model: Path | None = None) -> tuple[str, str]:
    """(text, corpus name): `path`'s, or with none the calibration part of the corpus of the
    built-in model `model` is (smolmoe's for any other model)."""
    if path is not None:
        return text_or_corpus(path, "calibration"), path.name
    corpus = text_or_corpus(None, "calibration", builtin_of(model) or RECIPE_NAME)
    return corpus, default_corpus_name(model)


def default_work_dir(model: Path, fp: str, corpus: str, text: str, tokens: int, n_ctx: int) -> Path:
    key = hashlib.sha256(f"{fp}|{corpus}|{tokens}|{n_ctx}|".encode() + text.encode()).hexdigest()[:12]
    stem = model.name[: -len(".gguf")] if model.name.endswith(".gguf") else model.name
    return cache_dir() / "calibrate" / f"{stem}-{key}"


def run_calibration(
    model: Path,
    output: Path | None = None,
    text_file: Path | None = None,
    *,
    rank: int = 8,
    draft_rank: int = 128,
    tokens: int = 8192,
    expert_tokens: int = 2048,
    n_ctx: int = 512,
    threads: int | None = None,
    work_dir: Path | None = None,
    keep_work: bool = False,
    progress: bool = True,
) -> CalibrateResult:
    """The calibration behind `pyspice calibrate` (and a model's first use)."""
    if rank < 0 or draft_rank < 1 or tokens < 2 or n_ctx < 2:
        raise ValueError("--rank >= 0, --draft-rank >= 1, --tokens >= 2 and --ctx-size >= 2 are needed")
    text, corpus = calibration_text(text_file, model)
    # before any work: a bad -o (the model itself, a directory) fails now, not after the run
    out = check_sidecar_output(output or default_sidecar_path(model), model)
    work = work_dir or default_work_dir(model, fingerprint(model), corpus, text, tokens, n_ctx)
    lore = LoreConfig()
    config = CalibrateConfig(
        capture=CaptureConfig(tokens=tokens, n_ctx=n_ctx, threads=threads),
        lore=replace(
            lore,
            rank=rank,
            report_ranks=tuple(sorted({*lore.report_ranks, rank})),
            max_train_tokens=expert_tokens,
        ),
        draft_rank=draft_rank,
    )
    result = calibrate(model, text, out, work, config, corpus=corpus, progress=progress)
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x != x else format(x, spec)  # NaN -> "-"


def summary_doc(result: CalibrateResult) -> dict[str, Any]:
    layers = result.layers
    ranks = sorted({r for s in layers for r in s.error_by_rank})

    def mean(values: list[float]) -> float:
        vals = [v for v in values if v == v]
        return sum(vals) / len(vals) if vals else float("nan")

    expert_bytes = mean([float(s.expert_bytes) for s in layers])
    return {
        "sidecar": str(result.sidecar),
        "tokens": result.tokens,
        "capture_s": result.capture_s,
        "fit_s": result.fit_s,
        "trace_bytes": result.trace_bytes,
        "sidecar_bytes": result.sidecar_bytes,
        "draft": {
            "recall_baseline_depth1": mean([s.recall_base for s in layers]),
            "recall_draft_depth1": mean([s.recall_draft for s in layers]),
            "r2": mean([s.draft_r2 for s in layers]),
        },
        "surrogate": {
            "ranks": ranks,
            "error": [mean([s.error_by_rank.get(r, float("nan")) for s in layers]) for r in ranks],
            "error_shared_alone": mean([s.shared_error for s in layers]),
            "error_drop": 1.0,
            "bytes_per_expert": mean([s.surrogate_bytes for s in layers]),
            "expert_bytes": expert_bytes,
        },
        "layers": [
            {
                "layer": s.layer,
                "draft_r2": s.draft_r2,
                "recall_baseline": s.recall_base,
                "recall_draft": s.recall_draft,
                "surrogate_error": {str(r): v for r, v in s.error_by_rank.items()},
                "shared_alone_error": s.shared_error,
            }
            for s in layers
        ],
    }


def format_summary(result: CalibrateResult) -> str:
    """The per-layer table and totals `pyspice calibrate` prints."""
    doc = summary_doc(result)
    ranks = doc["surrogate"]["ranks"]
    head = (
        ["layer", "draft R2", "recall@1 base", "recall@1 draft"] + [f"err r{r}" for r in ranks] + ["shared"]
    )
    rows = [
        [
            str(s["layer"]),
            _fmt(s["draft_r2"]),
            _fmt(s["recall_baseline"]),
            _fmt(s["recall_draft"]),
            *[_fmt(s["surrogate_error"].get(str(r), float("nan"))) for r in ranks],
            _fmt(s["shared_alone_error"]),
        ]
        for s in doc["layers"]
    ]
    d, sg = doc["draft"], doc["surrogate"]
    rows.append(
        [
            "mean",
            _fmt(d["r2"]),
            _fmt(d["recall_baseline_depth1"]),
            _fmt(d["recall_draft_depth1"]),
            *[_fmt(e) for e in sg["error"]],
            _fmt(sg["error_shared_alone"]),
        ]
    )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        "held-out relative error of each expert's output (drop = 1.000); recall@1 = top-k recall one MoE "
        "layer ahead on held-out blocks of the calibration text"
    )
    lines.append(
        f"{doc['tokens']} tokens; capture {doc['capture_s']:.1f} s, fit {doc['fit_s']:.1f} s; trace "
        f"{doc['trace_bytes'] / 2**20:.1f} MiB; sidecar {doc['sidecar_bytes'] / 2**20:.2f} MiB "
        f"({doc['sidecar']}); surrogate {sg['bytes_per_expert'] / 1024:.1f} KiB per expert = "
        f"{100 * sg['bytes_per_expert'] / max(sg['expert_bytes'], 1):.1f}% of an expert's "
        f"{sg['expert_bytes'] / 1024:.1f} KiB"
    )
    return "\n".join(lines)


def ensure_sidecar(model: Path, *, progress: bool = True, force: bool = False, **settings: Any) -> Path:
    """The model's sidecar beside it (`<model>.spice.gguf`), made on first use with
    `pyspice calibrate`'s defaults (`settings` override them, as run_calibration's
    keywords) and kept. A sidecar there that does not match the model (a rebuilt
    file) is made again."""
    out = default_sidecar_path(model)
    if out.is_file() and not force:
        try:
            Sidecar.load(out, model)
            return out
        except (SidecarMismatchError, ValueError):
            pass
    run_calibration(model, out, progress=progress, **settings)
    return out
