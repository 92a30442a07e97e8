"""Sidecar GGUF: round trip with tiny arrays; a sidecar made for another model is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from pyspice.formats.sidecar import (
    LayerSurrogates,
    Sidecar,
    SidecarData,
    SidecarMismatchError,
    fingerprint,
    write_sidecar,
)
from pyspice.policy.predictor import Transition

D, E, R = 8, 4, 3


def tiny_model(path: Path, seed: int) -> Path:
    """A two-layer GGUF with just routers: all the sidecar needs of a model."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "qwen2moe")
    for il in (0, 1):
        w.add_tensor(f"blk.{il}.ffn_gate_inp.weight", rng.standard_normal((E, D)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def data_for(model: Path) -> SidecarData:
    rng = np.random.default_rng(3)
    A = rng.standard_normal((E, R, D)).astype(np.float32)
    B = rng.standard_normal((E, D, R)).astype(np.float32)
    rank = np.array([3, 2, 0, 1], dtype=np.int32)
    for e in range(E):  # rows beyond the rank are padding
        A[e, rank[e] :] = 0
        B[e, :, rank[e] :] = 0
    surr = LayerSurrogates(
        A=A,
        B=B,
        alpha=np.array([1.0, 0.5, 0.0, 0.9], dtype=np.float32),
        rank=rank,
        error=np.array([0.1, 0.2, np.nan, 0.3], dtype=np.float32),
        error_shared=np.full(E, 0.8, dtype=np.float32),
        error_drop=np.ones(E, dtype=np.float32),
    )
    t = Transition(
        rng.standard_normal((D, 2)).astype(np.float32),
        rng.standard_normal((2, D)).astype(np.float32),
        rng.standard_normal(D).astype(np.float32),
        scale=0.75,
    )
    return SidecarData(
        model=model.name,
        fingerprint=fingerprint(model),
        moe_layers=[0, 1],
        n_embd=D,
        n_expert=E,
        n_expert_used=2,
        corpus="pydoc_data.topics:calibration",
        tokens=1234,
        draft_rank=2,
        lore_rank=R,
        transitions={0: t},
        surrogates={0: surr, 1: surr},
    )


def test_sidecar_round_trip(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "a.gguf", 0)
    data = data_for(model)
    path = write_sidecar(tmp_path / "a.spice.gguf", data)
    s = Sidecar.load(path, model)
    assert s.tokens == 1234 and s.corpus == data.corpus and s.moe_layers == [0, 1]
    alpha, A, B = s.surrogate(0, 1)  # type: ignore[misc]
    assert alpha == 0.5 and A.shape == (2, D) and B.shape == (D, 2) and A.dtype == np.float32
    np.testing.assert_allclose(A, data.surrogates[0].A[1, :2], rtol=1e-3, atol=1e-3)  # stored as f16
    np.testing.assert_allclose(B, data.surrogates[0].B[1, :, :2], rtol=1e-3, atol=1e-3)
    assert s.surrogate(0, 2) is None  # rank 0 and alpha 0: nothing fitted
    assert s.surrogate(0, 3) is not None and s.surrogate(5, 0) is None
    assert s.surrogate_error[0][0] == pytest.approx(0.1)
    assert s.surrogate_bytes() == 2 * ((3 + 2 + 0 + 1) * 2 * D * 2 + 4 * E)
    p = s.predictor()
    t0 = data.transitions[0]
    np.testing.assert_allclose(p.transitions[0].U, t0.U, rtol=1e-3, atol=1e-3)  # f16
    np.testing.assert_array_equal(p.transitions[0].bias, t0.bias)
    assert p.transitions[0].scale == 0.75
    assert [m for m, _ in p.rollout(0, np.ones(D, dtype=np.float32), 3)] == [1]


def big_sidecar(tmp_path: Path) -> tuple[Path, Path, SidecarData, int]:
    """(model, sidecar, its data, bytes of its stored matrices): a sidecar whose weight
    matrices dwarf everything else it holds."""
    model = tiny_model(tmp_path / "a.gguf", 0)
    data = data_for(model)
    big = 256  # experts: the matrices dwarf everything else the sidecar holds
    rng = np.random.default_rng(0)
    data.surrogates = {
        il: LayerSurrogates(
            A=rng.standard_normal((big, R, 256)).astype(np.float32),
            B=rng.standard_normal((big, 256, R)).astype(np.float32),
            alpha=np.ones(big, np.float32),
            rank=np.full(big, R, np.int32),
            error=np.full(big, 0.5, np.float32),
            error_shared=np.ones(big, np.float32),
            error_drop=np.ones(big, np.float32),
        )
        for il in (0, 1)
    }
    data.n_embd, data.n_expert = 256, big
    data.transitions = {
        0: Transition(
            rng.standard_normal((256, 32)).astype(np.float32),
            rng.standard_normal((32, 256)).astype(np.float32),
            np.zeros(256, np.float32),
            0.5,
        )
    }
    path = write_sidecar(tmp_path / "a.spice.gguf", data)
    matrices = sum(s.A.nbytes + s.B.nbytes for s in data.surrogates.values()) // 2  # as f16
    return model, path, data, matrices


def test_loading_copies_no_weight_matrix(tmp_path: Path) -> None:
    """The surrogates and transitions stay in the file's mapping until a policy reads them:
    a lossless policy never does, and on an edge box their float32 copies (50 MiB for
    smolmoe-b) pushed every row under the memory limit into thrashing its own weights."""
    import tracemalloc

    model, path, data, matrices = big_sidecar(tmp_path)
    tracemalloc.start()
    try:
        s = Sidecar.load(path, model)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < matrices / 2, f"loading allocated {peak} bytes for {matrices} bytes of stored matrices"
    got = s.data.surrogates[0].A
    assert got.dtype == np.float16 and not got.flags.writeable  # the file's bytes, read-only
    _, A, B = s.surrogate(1, 5)  # type: ignore[misc]
    assert A.dtype == np.float32 and B.dtype == np.float32
    np.testing.assert_allclose(A, data.surrogates[1].A[5], rtol=1e-2, atol=1e-2)
    # once read, the pages leave the resident set on release_pages, and read back the same
    s.check_weights()
    assert _resident_bytes(path) >= matrices
    layer = s.data.surrogates[0]
    s.release_views(layer.A, layer.B)  # one layer's: about half of them leave
    assert matrices / 3 < _resident_bytes(path) < matrices * 2 / 3
    s.release_views(np.zeros(3, np.float16))  # not of the mapping: nothing happens
    s.release_pages()
    assert _resident_bytes(path) < matrices / 8
    np.testing.assert_array_equal(s.surrogate(1, 5)[1], A)  # type: ignore[index]


def _resident_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_loading_leaves_the_file_out_of_the_page_cache(tmp_path: Path) -> None:
    """Loading reads no matrix into the page cache either (no read-ahead around the small
    tensors it copies), and release_pages drops what a policy read: the cache counts in
    a memory cgroup's usage, which edge mode's memory limit is taken from (the kernel's
    read-ahead pulled all 25 MiB of smolmoe-b's sidecar into a lossless row's cgroup)."""
    from pyspice.measure.pagecache import drop, resident_bytes

    model, path, _, matrices = big_sidecar(tmp_path)
    drop(path)
    if resident_bytes(path) > 0:
        pytest.skip("this file system keeps files in memory (tmpfs): no page cache to leave")
    s = Sidecar.load(path, model)
    assert resident_bytes(path) < matrices / 8
    s.check_weights()  # reads every matrix
    assert resident_bytes(path) >= matrices
    layer = s.data.surrogates[0]
    s.release_views(layer.A, layer.B)
    assert matrices / 3 < resident_bytes(path) < matrices * 2 / 3
    s.release_pages()
    assert resident_bytes(path) < matrices / 8


def test_sidecar_for_another_model_is_refused(tmp_path: Path) -> None:
    a = tiny_model(tmp_path / "a.gguf", 0)
    b = tiny_model(tmp_path / "b.gguf", 1)  # same names and shapes, other weights
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(a)
    path = write_sidecar(tmp_path / "a.spice.gguf", data_for(a))
    with pytest.raises(SidecarMismatchError, match=r"made for model a\.gguf"):
        Sidecar.load(path, b)
    with pytest.raises(FileNotFoundError, match="pyspice calibrate"):
        Sidecar.load(tmp_path / "none.gguf", a)


def test_sidecar_round_trips_the_tuned_level_thresholds(tmp_path: Path) -> None:
    from pyspice.formats.sidecar import read_sidecar, with_levels
    from pyspice.policy.spice import SurrogateThresholds

    model = tiny_model(tmp_path / "a.gguf", 0)
    data = data_for(model)
    data.levels = {"spice:balanced": SurrogateThresholds(0.05, 0.45)}
    data.levels_tuned_on = "test text"
    path = write_sidecar(tmp_path / "a.spice.gguf", data)
    s = Sidecar.load(path, model)
    assert s.levels == {"spice:balanced": SurrogateThresholds(0.05, 0.45)}  # f64: exactly
    assert s.data.levels_tuned_on == "test text"
    # rewritten with other thresholds, everything else stays as it was
    with_levels(path, {"spice:fast": SurrogateThresholds(1.0, 0.7)}, "again")
    again = read_sidecar(path)
    assert again.levels == {"spice:fast": SurrogateThresholds(1.0, 0.7)} and again.levels_tuned_on == "again"
    assert again.fingerprint == data.fingerprint and again.tokens == data.tokens
    for il in (0, 1):
        np.testing.assert_array_equal(again.surrogates[il].A, s.data.surrogates[il].A)
        np.testing.assert_array_equal(again.surrogates[il].error, s.data.surrogates[il].error)
    np.testing.assert_array_equal(again.transitions[0].U, s.data.transitions[0].U)


def test_a_sidecar_without_level_thresholds_still_loads(tmp_path: Path) -> None:
    # what every sidecar written before the thresholds existed is: no spice.levels.* keys
    model = tiny_model(tmp_path / "a.gguf", 0)
    path = write_sidecar(tmp_path / "a.spice.gguf", data_for(model))
    from gguf import GGUFReader

    assert not [k for k in GGUFReader(path).fields if k.startswith("spice.levels")]
    s = Sidecar.load(path, model)
    assert s.levels == {} and s.data.levels_tuned_on == ""


def test_a_level_with_half_its_thresholds_is_refused(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "a.gguf", 0)
    data = data_for(model)
    path = tmp_path / "a.spice.gguf"
    write_sidecar(path, data)
    # the same sidecar with only one of balanced's two keys
    from gguf import GGUFReader

    reader = GGUFReader(path)
    w = GGUFWriter(tmp_path / "b.spice.gguf", "spice-sidecar")
    for key, f in reader.fields.items():
        if key.startswith("spice.") and not isinstance(f.contents(), list):
            value = f.contents()
            if isinstance(value, str):
                w.add_string(key, value)
            elif isinstance(value, bool):
                w.add_bool(key, value)
            else:
                w.add_uint32(key, int(value))
    w.add_float64("spice.levels.balanced.max_weight", 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="only one of"):
        Sidecar.load(tmp_path / "b.spice.gguf", None)
