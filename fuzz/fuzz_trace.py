"""atheris harness: the trace reader on arbitrary bytes. A trace is a directory, so the
input's first byte picks the file it replaces in a small valid trace -- 0: meta.json,
1: layer 0's first chunk (.npz), 2: a chunk file under a name the reader also scans --
and the rest is that file's bytes. Contract: TraceReader, routing() and replaying the
calls raise TraceError (a ValueError) or return.
`python fuzz/fuzz_trace.py fuzz/corpus/trace -max_total_time=15 -timeout=1 -rss_limit_mb=512`
(make the seed corpus with `python fuzz/fuzz_trace.py --seeds fuzz/corpus/trace`)."""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
from pathlib import Path

import atheris
import numpy as np  # not instrumented: the reader is the target

with atheris.instrument_imports():
    from pyspice.formats.trace import TraceError, TraceMeta, TraceReader, TraceWriter

LAYERS, N_EXPERT, K, N_EMBD, N_TOKENS = [0, 2], 6, 2, 4, 6
ROOT = Path(tempfile.mkdtemp(prefix="fuzz-trace-"))
PRISTINE = ROOT / "pristine"
WORK = ROOT / "work"
TARGETS = ("meta.json", "L0000_T0000000000_N0000003.npz", "L0002_T0000000003_N0000003.npz")


def make_trace(path: Path) -> None:
    """A complete trace: two MoE layers, six tokens in chunks of three."""
    meta = TraceMeta(
        model="fuzz.gguf", fingerprint="", n_layers=3, moe_layers=LAYERS, n_expert=N_EXPERT,
        n_expert_used=K, n_embd=N_EMBD, fields=["hidden", "probs", "ids", "weights", "shared"],
    )  # fmt: skip
    rng = np.random.default_rng(0)
    with TraceWriter(path, meta, chunk_tokens=3) as w:
        for il in LAYERS:
            probs = rng.random((N_TOKENS, N_EXPERT)).astype(np.float32)
            ids = np.argsort(-probs, axis=1)[:, :K]
            rows = dict(
                hidden=rng.standard_normal((N_TOKENS, N_EMBD)), probs=probs, ids=ids,
                weights=np.take_along_axis(probs, ids, axis=1), shared=np.zeros((N_TOKENS, N_EMBD)),
            )  # fmt: skip
            for start in (0, 3):
                w.add(il, start, **{k: v[start : start + 3] for k, v in rows.items()})


def one_input(data: bytes) -> None:
    if not data:
        return
    shutil.rmtree(WORK, ignore_errors=True)
    shutil.copytree(PRISTINE, WORK)
    (WORK / TARGETS[data[0] % len(TARGETS)]).write_bytes(data[1:])
    try:
        reader = TraceReader(WORK, allow_incomplete=bool(data[0] & 0x80))
        reader.routing()
        for _ in itertools.islice(reader.calls(), 16):
            pass
    except TraceError:
        pass  # the documented error


def write_seeds(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(TARGETS):
        (corpus / f"{i}-{name}").write_bytes(bytes([i]) + (PRISTINE / name).read_bytes())


make_trace(PRISTINE)

if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["--seeds"]:
            write_seeds(Path(sys.argv[2]))
        else:
            atheris.Setup(sys.argv, one_input)
            atheris.Fuzz()
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
