"""Bad inputs without native code: each is refused with one line naming the input and
the fix, before any work, and no file is changed (the classes of
shared/reviews/bad-inputs-2026-12-01.md)."""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyspice.calibrate.run import run_calibration
from pyspice.cli.main import main
from pyspice.engine.config import RunConfig, check_sidecar_weights
from pyspice.formats import sidecar as sidecar_mod
from pyspice.formats.model_info import ModelFileError, read_header
from pyspice.formats.sidecar import Sidecar, SidecarDataError, write_sidecar
from pyspice.measure.perplexity import perplexity
from pyspice.outputs import OutputPathError, atomic_output
from tests.unit.test_inspect_header import write_moe
from tests.unit.test_sidecar import data_for, tiny_model


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_error_line(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("pyspice: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- outputs: never onto an input, never half-written ----------------------------------------


def test_calibrate_output_onto_its_own_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Row 47: `calibrate -m m.gguf -o m.gguf` replaced the model by its sidecar, exit 0."""
    model = write_moe(tmp_path / "m.gguf")
    before = digest(model)
    status = main(["calibrate", "-m", str(model), "-o", str(model), "--work-dir", str(tmp_path / "wd")])
    assert status == 1
    one_error_line(capsys.readouterr().err, str(model), "pick another path")
    assert digest(model) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no work dir, no temporary file


def test_calibrate_output_through_a_link_to_its_model_is_refused(tmp_path: Path) -> None:
    model = write_moe(tmp_path / "m.gguf")
    (tmp_path / "link.gguf").symlink_to(model)
    with pytest.raises(OutputPathError, match="is the input"):
        run_calibration(model, tmp_path / "link.gguf", work_dir=tmp_path / "wd")


def test_calibrate_output_onto_another_model_is_refused(tmp_path: Path) -> None:
    model = write_moe(tmp_path / "m.gguf")
    other = write_moe(tmp_path / "other.gguf", n_layers=2)
    before = digest(other)
    with pytest.raises(OutputPathError, match="not a pyspice sidecar"):
        run_calibration(model, other, work_dir=tmp_path / "wd")
    assert digest(other) == before


def test_calibrate_output_into_a_directory_fails_before_the_run(tmp_path: Path) -> None:
    """Row 48: `-o DIR` failed only at the final rename, leaving DIR.tmp behind."""
    model = write_moe(tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputPathError, match="is a directory"):
        run_calibration(model, tmp_path / "out", work_dir=tmp_path / "wd")
    with pytest.raises(OutputPathError, match="does not exist"):
        run_calibration(model, tmp_path / "missing" / "s.gguf", work_dir=tmp_path / "wd")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]
    assert not any((tmp_path / "out").iterdir())


def test_a_failed_sidecar_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(tmp_path / "a.gguf", 0)
    old = write_sidecar(tmp_path / "a.spice.gguf", data_for(model))
    before = digest(old)

    def broken(tmp: Path, data: object) -> None:
        tmp.write_bytes(b"half a sidecar")
        raise KeyboardInterrupt  # Ctrl-C mid-write

    monkeypatch.setattr(sidecar_mod, "_write_sidecar_to", broken)
    with pytest.raises(KeyboardInterrupt):
        write_sidecar(old, data_for(model))
    assert digest(old) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "a.spice.gguf"]


def test_atomic_output_replaces_only_on_success(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    out.write_text("old")
    with pytest.raises(ValueError), atomic_output(out) as tmp:
        tmp.write_text("new")
        raise ValueError("boom")
    assert out.read_text() == "old" and list(tmp_path.iterdir()) == [out]
    with atomic_output(out) as tmp:
        tmp.write_text("new")
    assert out.read_text() == "new" and list(tmp_path.iterdir()) == [out]


# ---- sidecars: finite weights -----------------------------------------------------------------


@pytest.mark.parametrize("tensor", ["A", "B"])
def test_sidecar_with_non_finite_surrogate_matrix_is_refused_where_read(tmp_path: Path, tensor: str) -> None:
    """Row 24: NaN LoRE weights made spice:fast emit token 0 forever, exit 0. The
    matrices are checked when first read, not at load (a policy that never reads
    them pays no memory for them): by check_weights, by the surrogate itself, and
    by a lossy level's run before its model loads."""
    model = tiny_model(tmp_path / "a.gguf", 0)
    data = data_for(model)
    getattr(data.surrogates[1], tensor).reshape(-1)[1] = np.nan
    path = write_sidecar(tmp_path / "a.spice.gguf", data)
    match = rf"spice\.lore\.0\.{tensor.lower()} holds 1 NaN or infinite"
    loaded = Sidecar.load(path, model)
    loaded.check_weights(surrogates=False)  # the draft part is sound
    assert loaded.has_surrogate(0, 0)  # rank and alpha only: the matrices stay unread
    with pytest.raises(SidecarDataError, match=match):
        Sidecar.load(path, model).surrogate(0, 0)
    with pytest.raises(SidecarDataError, match=match):
        loaded.check_weights()
    check_sidecar_weights(Sidecar.load(path, model), "spice:exact")  # reads no surrogate
    with pytest.raises(SidecarDataError, match=match):
        check_sidecar_weights(Sidecar.load(path, model), "spice:fast")


def test_sidecar_with_non_finite_alpha_is_refused_at_load(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "a.gguf", 0)
    data = data_for(model)
    data.surrogates[1].alpha[1] = np.inf
    path = write_sidecar(tmp_path / "a.spice.gguf", data)
    with pytest.raises(SidecarDataError, match=r"spice\.lore\.0\.alpha holds 1 NaN or infinite"):
        Sidecar.load(path, model)


def test_sidecar_with_nan_transition_is_refused_where_read(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "a.gguf", 0)
    data = data_for(model)
    data.transitions[0].U[0, 0] = np.nan
    path = write_sidecar(tmp_path / "a.spice.gguf", data)
    loaded = Sidecar.load(path, model)
    check_sidecar_weights(loaded, "lru")  # a baseline reads nothing of it
    with pytest.raises(SidecarDataError, match=r"spice\.draft\.0\.u .*pyspice calibrate"):
        loaded.predictor()
    with pytest.raises(SidecarDataError, match=r"spice\.draft\.0\.u .*pyspice calibrate"):
        check_sidecar_weights(Sidecar.load(path, model), "spice:exact")


# ---- model files: the MoE metadata llama.cpp asserts on --------------------------------------


def _set_kv(path: Path, key: str, value: int, out: Path) -> Path:
    """A copy of `path` with the uint32 metadata `key` set to `value` (a one-field edit)."""
    raw = bytearray(path.read_bytes())
    name = key.encode()
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (vtype,) = struct.unpack_from("<I", raw, at)
    assert vtype == gguf.GGUFValueType.UINT32
    struct.pack_into("<I", raw, at + 4, value)
    out.write_bytes(bytes(raw))
    return out


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("deepseek2.expert_used_count", 64, "expert_used_count is 64"),
        ("deepseek2.expert_used_count", 0, "expert_used_count is 0"),
        ("deepseek2.expert_count", 2, "holds 4 experts but deepseek2.expert_count is 2"),
        ("deepseek2.expert_count", 0, "expert_count is 0"),
    ],
)
def test_inconsistent_expert_counts_are_refused_before_llama_cpp(
    tmp_path: Path, key: str, value: int, message: str
) -> None:
    """Rows 16-17: these made every command exit 134 with no message, and inspect said valid."""
    bad = _set_kv(write_moe(tmp_path / "m.gguf"), key, value, tmp_path / "bad.gguf")
    with pytest.raises(ModelFileError, match=message):
        read_header(bad)


def test_inspect_reports_inconsistent_expert_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _set_kv(write_moe(tmp_path / "m.gguf"), "deepseek2.expert_used_count", 64, tmp_path / "bad.gguf")
    before = digest(bad)
    assert main(["inspect", "-m", str(bad)]) == 1
    one_error_line(capsys.readouterr().err, str(bad), "expert_used_count is 64", "re-download")
    assert digest(bad) == before


def test_misaligned_tensor_offset_is_refused(tmp_path: Path) -> None:
    good = write_moe(tmp_path / "m.gguf")
    header = read_header(good)
    raw = bytearray(good.read_bytes())
    t = header.tensors[-1]
    # the offset is the last u64 of the tensor's directory entry
    entry = raw.index(struct.pack("<Q", len(t.name)) + t.name.encode())
    at = entry + 8 + len(t.name) + 4 + 8 * len(t.shape) + 4
    struct.pack_into("<Q", raw, at, t.offset + 1)
    (tmp_path / "bad.gguf").write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="not a multiple of the file's alignment 32"):
        read_header(tmp_path / "bad.gguf")


# ---- a broken sidecar picked up automatically --------------------------------------------------


def _model_with_sidecar_beside(tmp_path: Path, broken: str) -> Path:
    model = write_moe(tmp_path / "m.gguf")
    beside = tmp_path / "m.spice.gguf"
    if broken == "random":
        beside.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        data = data_for(model)
        data.surrogates[0].A[0, 0, 0] = np.nan
        write_sidecar(beside, data)
    return model


@pytest.mark.parametrize("broken", ["random", "nan"])
def test_a_broken_sidecar_beside_the_model_is_skipped_for_policies_that_do_not_use_it(
    tmp_path: Path, broken: str
) -> None:
    """Row 23: a random-bytes <model>.spice.gguf blocked even exact and lru."""
    model = _model_with_sidecar_beside(tmp_path, broken)
    notes: list[str] = []
    run = RunConfig(model, policy="lru", device_budget="50%").resolve(notes.append)
    if broken == "random":
        assert run.sidecar is None and run.loaded_sidecar is None
        assert any(n.startswith("warning: ignoring") and "m.spice.gguf" in n for n in notes), notes
    else:  # its weights are read only by a policy that uses them: lru never sees the NaN
        assert run.loaded_sidecar is not None and not any(n.startswith("warning") for n in notes)
    with pytest.raises(ValueError, match=r"sidecar beside the model cannot be used: .*--no-sidecar"):
        RunConfig(model, policy="spice:fast", device_budget="50%").resolve()


def test_a_good_sidecar_beside_the_model_is_loaded_once(tmp_path: Path) -> None:
    model = write_moe(tmp_path / "m.gguf")
    write_sidecar(tmp_path / "m.spice.gguf", data_for(model))
    run = RunConfig(model, policy="spice", device_budget="50%").resolve()
    assert run.sidecar == tmp_path / "m.spice.gguf" and run.loaded_sidecar is not None


# ---- numeric flags: one line naming the flag, the value and the range, before anything loads --

FLAG_CASES = [
    (["eval", "ppl", "--chunks", "0"], "--chunks", "at least 1"),  # row 44: scored 1 chunk
    (["eval", "ppl", "--chunks", "-3"], "--chunks", "at least 1"),
    (["generate", "-p", "hi", "-t", "0"], "--threads", "at least 1"),  # row 32
    (["generate", "-p", "hi", "-t", "-2"], "--threads", "at least 1"),
    (["generate", "-p", "hi", "-n", "-5"], "--n-predict", "at least 1"),  # row 35
    (["generate", "-p", "hi", "-b", "0"], "--batch-size", "at least 1"),  # row 38
    (["generate", "-p", "hi", "--max-hook-tokens", "-3"], "--max-hook-tokens", "at least 0"),  # row 39
    (["generate", "-p", "hi", "--temp", "-1"], "--temp", "at least 0"),  # row 40
    (["generate", "-p", "hi", "--top-p", "2"], "--top-p", "0 to 1"),
    (["generate", "-p", "hi", "--top-k", "-5"], "--top-k", "at least 0"),
    (["generate", "-p", "hi", "--emulate-bandwidth", "0"], "--emulate-bandwidth", "above 0"),  # row 30
    (["generate", "-p", "hi", "--emulate-bandwidth", "nan"], "--emulate-bandwidth", "at least 0"),
    (["generate", "-p", "hi", "--emulate-latency", "-10"], "--emulate-latency", "at least 0"),
    (["bench", "--prompt-tokens", "-8"], "--prompt-tokens", "at least 0"),  # row 42
    (["serve", "--port", "-1"], "--port", "0 to 65535"),  # row 49
    (["serve", "--port", "70000"], "--port", "0 to 65535"),
    (["serve", "--port", "http"], "--port", "not an integer"),
]


@pytest.mark.parametrize(("argv", "flag", "allowed"), FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_a_bad_numeric_flag_is_one_line_before_anything_runs(
    argv: list[str], flag: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0] and allowed in errors[0], errors


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"threads": 0}, "-t/--threads 0: must be at least 1"),
        ({"n_ctx": 0}, "-c/--ctx-size 0"),
        ({"max_hook_tokens": -3}, "--max-hook-tokens -3"),
        ({"device_budget": -5}, "device budget -5: must be at least 1"),  # row 52: OverflowError
        ({"device_budget": 0.25}, "give bytes as an integer, or a string such as"),  # meant 25%?
        ({"device_budget": "25%", "emulate_bandwidth": float("nan")}, "--emulate-bandwidth nan"),
        ({"device_budget": "25%", "emulate_latency": -1.0}, "--emulate-latency -1.0"),
    ],
)
def test_run_settings_are_checked_where_the_api_enters(
    tmp_path: Path, setting: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RunConfig(tmp_path / "m.gguf", **setting)  # type: ignore[arg-type]


def test_threads_above_the_cores_warn_once_and_run(tmp_path: Path) -> None:
    """Row 33: -t 1000 on 2 cores ran 120 s for one token with no word said."""
    model = write_moe(tmp_path / "m.gguf")
    notes: list[str] = []
    run = RunConfig(model, policy="exact", threads=1000).resolve(notes.append)
    assert run.threads == 1000
    assert len([n for n in notes if "-t 1000 is more threads than this machine's" in n]) == 1, notes


def test_perplexity_refuses_zero_chunks() -> None:
    with pytest.raises(ValueError, match=r"--chunks 0: must be at least 1"):
        perplexity(None, "some text", 64, max_chunks=0)  # type: ignore[arg-type]


# ---- prompt batches on a GPU tier keep upstream's path above the pool's largest bucket --------


def test_prompt_batches_keep_upstreams_path_on_a_gpu_tier_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyspice.engine.config as config

    model = write_moe(tmp_path / "m.gguf")
    monkeypatch.setattr(config, "gpu_present", lambda: False)
    assert RunConfig(model, policy="lru", device_budget="50%").resolve().max_hook_tokens == 0
    monkeypatch.setattr(config, "gpu_present", lambda: True)
    notes: list[str] = []
    run = RunConfig(model, policy="lru", device_budget="50%").resolve(notes.append)
    assert run.max_hook_tokens == config.PREFILL_HOOK_TOKENS == 32
    assert any("keep upstream's path" in n for n in notes), notes
    told = RunConfig(model, policy="lru", device_budget="50%", max_hook_tokens=0).resolve()
    assert told.max_hook_tokens == 0
    assert RunConfig(model, policy="stock").resolve().max_hook_tokens == 0  # no hook, nothing to say
