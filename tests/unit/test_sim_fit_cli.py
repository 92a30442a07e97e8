"""`pyspice sim fit` on edge-mode runs: the disk terms fitted from the command line,
written as a profile or into the machine's probe, and the wrong inputs refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyspice.cli.main import main
from pyspice.formats.profile import load_profile as load_cost_profile
from pyspice.formats.trace import TraceMeta, TraceWriter
from pyspice.sim.fit_disk import DISK_TERMS
from pyspice.sim.hardware import load_profile

from .test_sim_disk import _probe
from .test_sim_report import _tiny_moe


def _inputs(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """A two-layer model, 24 tokens of its routing (ids only), its probe with a disk, and
    a results record of two RAM budgets."""
    model = _tiny_moe(tmp_path / "m.gguf", tied=False)
    rng = np.random.default_rng(3)
    meta = TraceMeta(
        model="m", fingerprint="", n_layers=2, moe_layers=[0, 1], n_expert=4, n_expert_used=2,
        n_embd=0, fields=["ids"], source="imported", hidden_rows=False,
    )  # fmt: skip
    trace = tmp_path / "trace"
    with TraceWriter(trace, meta, chunk_tokens=8) as w:
        for il in (0, 1):
            ids = np.stack([rng.permutation(4)[:2] for _ in range(24)]).astype(np.int32)
            w.add(il, 0, ids=ids)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(_probe(model, disk=True).to_json()))
    rows = {"exact": {"tpot_ms": 0.6}, "lru": {"tpot_ms": 0.55, "decode_hit_rate": 0.4}}
    record = tmp_path / "runs.json"
    record.write_text(
        json.dumps({"runs": [{"tier": "ram-budget", "budget": b, "rows": rows} for b in ("25%", "50%")]})
    )
    return model, trace, probe, record


def test_edge_runs_fit_into_a_profile_and_into_the_probe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace, probe, record = _inputs(tmp_path)
    out = tmp_path / "fitted.json"
    argv = ["sim", "fit", str(record), "-m", str(model), "--trace", str(trace), "--probe", str(probe)]
    assert main([*argv, "--budget", "25%", "-o", str(out), "--save-to-probe"]) == 0
    said = capsys.readouterr().out
    assert "fitted the disk terms to 1 run(s)" in said and "disk terms saved into the probe" in said
    fitted = load_profile(str(out))
    assert fitted.disk and fitted.name == "fitted"
    saved = load_cost_profile(probe).disk_terms
    assert saved is not None and set(saved) == set(DISK_TERMS)
    for key in DISK_TERMS:  # the profile and the probe hold the same terms
        assert fitted.optional(key) == pytest.approx(saved[key], abs=1e-3), key


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-o", "x.json"], "needs -m MODEL and --trace SAMPLE"),  # edge runs without the model
        (["-m", "MODEL", "-o", "x.json"], "needs both -m MODEL and --trace SAMPLE"),
        (["-m", "MODEL", "--trace", "TRACE"], "give -o PROFILE.json, --save-to-probe, or both"),
        (["-m", "MODEL", "--trace", "TRACE", "--budget", "10%", "-o", "x.json"], "no RAM-budget run of 10%"),
        (["--budget", "25%", "-o", "x.json"], "fit edge-mode runs: give -m and --trace"),
    ],
)
def test_wrong_inputs_are_refused_before_any_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    model, trace, _probe_file, record = _inputs(tmp_path)
    extra = [str(model) if a == "MODEL" else str(trace) if a == "TRACE" else a for a in extra]
    extra = [str(tmp_path / a) if a.endswith(".json") else a for a in extra]
    assert main(["sim", "fit", str(record), *extra]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
