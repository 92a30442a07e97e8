"""`pyspice trace import`: routing recordings (csv-ids, vllm-jsonl) read into ids-only traces.

Every fixture is written here, from routes drawn at random, so each test knows
the ids (and the line of every row) it must find again.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from pyspice.cli.main import main
from pyspice.formats.importers import (
    ImportOptions,
    ModelShape,
    RecordingError,
    detect_format,
    import_recording,
)
from pyspice.formats.importers.csv_ids import HEADER
from pyspice.formats.trace import TraceReader

N_EXPERT, K = 8, 2
LAYERS = (1, 2, 3)
OPTIONS = ImportOptions(n_expert=N_EXPERT)


def routes(n: int, seed: int) -> np.ndarray:
    """[n, L, k] distinct experts per row."""
    rng = np.random.default_rng(seed)
    return np.array([[rng.choice(N_EXPERT, K, replace=False) for _ in LAYERS] for _ in range(n)])


def write_csv(
    path: Path, ids: np.ndarray, *, token_major: bool = False, batches: list[int] | None = None
) -> dict[tuple[int, int], int]:
    """A csv-ids file of ids [T, L, k]; returns the line of each (token, layer index)."""
    n = ids.shape[0]
    order = [(t, j) for t in range(n) for j in range(len(LAYERS))]
    if not token_major:
        order.sort(key=lambda tj: (tj[1], tj[0]))
    lines = {}
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for number, (t, j) in enumerate(order, 2):
            batch = batches[t] if batches is not None else 0
            token = f'tok"{t}, with a comma'  # token text is quoted CSV, and never imported
            w.writerow([LAYERS[j], batch, token, "[" + ", ".join(str(int(e)) for e in ids[t, j]) + "]"])
            lines[(t, j)] = number
    return lines


def write_jsonl(
    path: Path,
    sequences: list[tuple[np.ndarray, np.ndarray]],
    *,
    meta: dict[str, object] | None = None,
    layer_major: bool = False,
) -> None:
    records: list[dict[str, object]] = []
    if meta is not None:
        records.append({"type": "meta", **meta})
    for ids, weights in sequences:
        n = ids.shape[0]
        order = [(t, j) for t in range(n) for j in range(len(LAYERS))]
        if layer_major:
            order.sort(key=lambda tj: (tj[1], tj[0]))
        for t, j in order:
            records.append(
                {
                    "type": "route",
                    "token_idx": t,
                    "layer": LAYERS[j],
                    "topk_ids": [int(e) for e in ids[t, j]],
                    "topk_weights": [float(x) for x in weights[t, j]],
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def read_back(path: Path) -> tuple[TraceReader, np.ndarray, np.ndarray]:
    reader = TraceReader(path)
    ids, weights = reader.routing()
    return reader, ids, weights


def test_csv_folder_imports_in_natural_order_each_file_a_sequence(tmp_path: Path) -> None:
    rec = tmp_path / "recording"
    rec.mkdir()
    parts = {n: routes(size, seed=n) for n, size in ((1, 4), (2, 3), (10, 5))}
    for n, ids in parts.items():
        write_csv(rec / f"prompt_{n}_data.csv", ids, token_major=n == 2)
    (rec / "README.txt").write_text("not a recording\n")
    summary = import_recording([rec], tmp_path / "trace", OPTIONS)
    reader, ids, weights = read_back(tmp_path / "trace")
    meta = reader.meta
    assert meta.ids_only and meta.fields == ["ids"] and meta.source == "imported"
    assert meta.moe_layers == list(LAYERS) and meta.n_layers == 4 and meta.n_expert == N_EXPERT
    assert meta.n_expert_used == K and meta.model == "recording"
    # prompt_2 before prompt_10: numbers by value, not by text
    assert reader.sequences() == [(0, 4), (4, 7), (7, 12)]
    np.testing.assert_array_equal(ids, np.concatenate([parts[1], parts[2], parts[10]]))
    np.testing.assert_allclose(weights, 1.0 / K)
    assert (summary.files, summary.sequences, summary.tokens, summary.dropped_batches) == (3, 3, 12, 0)
    assert "3 sequences, 12 tokens, 3 MoE layers x 8 experts, top-2" in summary.line()


def test_vllm_jsonl_splits_sequences_where_token_idx_starts_again(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    seqs = [(routes(n, seed=n), rng.random((n, len(LAYERS), K)).astype(np.float32)) for n in (3, 4, 2)]
    meta = {"model": "org/recorded-moe", "n_layers": 4, "n_experts": N_EXPERT, "top_k": K}
    write_jsonl(
        tmp_path / "a.jsonl", seqs[:2], meta=meta, layer_major=True
    )  # a prefill batch, layer by layer
    write_jsonl(tmp_path / "b.jsonl", seqs[2:], meta=meta)  # another file: another sequence
    summary = import_recording([tmp_path / "b.jsonl", tmp_path / "a.jsonl"], tmp_path / "trace")
    reader, ids, weights = read_back(tmp_path / "trace")
    assert reader.meta.model == "org/recorded-moe" and reader.meta.fields == ["ids", "weights"]
    assert reader.sequences() == [(0, 3), (3, 7), (7, 9)]
    np.testing.assert_array_equal(ids, np.concatenate([s[0] for s in seqs]))
    np.testing.assert_allclose(weights, np.concatenate([s[1] for s in seqs]), atol=1e-3)
    assert summary.format == "vllm-jsonl" and summary.has_weights


def test_format_is_told_by_the_first_line(tmp_path: Path) -> None:
    write_csv(tmp_path / "p.csv", routes(2, 0))
    write_jsonl(tmp_path / "r.txt", [(routes(2, 0), np.ones((2, 3, K)))])
    (tmp_path / "x.csv").write_text("a,b,c\n1,2,3\n")
    assert detect_format(tmp_path / "p.csv") == "csv-ids"
    assert detect_format(tmp_path / "r.txt") == "vllm-jsonl"
    with pytest.raises(RecordingError, match=r"x\.csv: cannot tell the recording's format.*--format"):
        detect_format(tmp_path / "x.csv")
    with pytest.raises(RecordingError, match=r"r\.txt: a vllm-jsonl file among csv-ids files"):
        import_recording([tmp_path / "p.csv", tmp_path / "r.txt"], tmp_path / "trace", OPTIONS)
    assert not (tmp_path / "trace").exists()


def _csv_case(tmp_path: Path, case: str) -> tuple[list[Path], str]:
    """A recording with one fault, and the `file:line` its error must name."""
    good = tmp_path / "prompt_1_data.csv"
    write_csv(good, routes(3, 1))
    bad = tmp_path / "prompt_2_data.csv"
    ids = routes(4, 2)
    lines = write_csv(bad, ids)
    text = bad.read_text().splitlines()
    line = lines[(2, 1)]
    row = text[line - 1]
    if case == "bad row":
        text[line - 1] = row.replace('"[', '"[x')
    elif case == "too few fields":
        text[line - 1] = "2,0"
    elif case == "out of range":
        text[line - 1] = row.rsplit(",", 1)[0] + f', {N_EXPERT}]"'
    elif case == "mixed k":
        text[line - 1] = row.replace("]", ", 7]")
    elif case == "layer token count":
        del text[line - 1]  # layer 2 loses token 2; its last row is then token 3's
        line = lines[(3, 1)] - 1
    bad.write_text("\n".join(text) + "\n")
    return [good, bad], f"{bad}:{line}:"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bad row", "is not a list of integers"),
        ("too few fields", "a row of 2 fields, not 4"),
        ("out of range", f"expert id {N_EXPERT} is outside 0..{N_EXPERT - 1}"),
        ("mixed k", "the row lists 3 experts, line 2 lists 2"),
        ("layer token count", "layer 2 has 3 tokens, layer 1 4"),
    ],
)
def test_a_bad_csv_row_names_file_and_line_and_writes_nothing(
    tmp_path: Path, case: str, message: str
) -> None:
    files, at = _csv_case(tmp_path, case)
    out = tmp_path / "out" / "trace"
    with pytest.raises(RecordingError) as err:
        import_recording(files, out, OPTIONS)
    assert str(err.value).startswith(at) and message in str(err.value)
    assert not out.exists() and list(out.parent.iterdir()) == []  # no hidden half-trace either


def _jsonl_case(tmp_path: Path, case: str) -> tuple[Path, str]:
    ids = routes(4, 3)
    path = tmp_path / "r.jsonl"
    write_jsonl(path, [(ids, np.full((4, 3, K), 0.5))], meta={"n_experts": N_EXPERT})
    records = path.read_text().splitlines()
    line = 8  # token 2 at layer 1 (token-major, after the meta line)
    route = json.loads(records[line - 1])
    if case == "bad row":
        records[line - 1] = records[line - 1][:-3]
    elif case == "out of range":
        route["topk_ids"] = [-1, 3]
    elif case == "mixed k":
        route["topk_ids"], route["topk_weights"] = [1, 2, 3], [0.3, 0.3, 0.4]
    elif case == "layer token count":
        records = records[: line - 1] + records[line:]  # layer 1 skips token 2
        line = 10  # where layer 1 goes on with token 3
    elif case == "weights on some":
        del route["topk_weights"]
    if case not in ("bad row", "layer token count"):
        records[line - 1] = json.dumps(route)
    path.write_text("\n".join(records) + "\n")
    return path, f"{path}:{line}:"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bad row", "not a JSON object"),
        ("out of range", "expert id -1 is outside 0..7"),
        ("mixed k", "the route lists 3 experts, line 2 lists 2"),
        ("layer token count", "layer 1 jumps from token_idx 1 to 3"),
        ("weights on some", "line 2 has topk_weights, line 8 has none"),
    ],
)
def test_a_bad_jsonl_route_names_file_and_line_and_writes_nothing(
    tmp_path: Path, case: str, message: str
) -> None:
    path, at = _jsonl_case(tmp_path, case)
    with pytest.raises(RecordingError) as err:
        import_recording([path], tmp_path / "trace")
    assert str(err.value).startswith(at) and message in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_a_jsonl_layer_missing_its_last_token_is_a_count_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_jsonl(path, [(routes(3, 4), np.full((3, 3, K), 0.5))] * 2, meta={"n_experts": N_EXPERT})
    records = path.read_text().splitlines()
    del records[9]  # token 2 of layer 3 in the first sequence (line 10)
    path.write_text("\n".join(records) + "\n")
    with pytest.raises(RecordingError, match=rf"^{path}:7: layer 3 has 2 tokens, layer 1 3"):
        import_recording([path], tmp_path / "trace")


def test_dummy_batches_are_dropped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = routes(5, 7)
    warm = np.broadcast_to(real[:1], (6, len(LAYERS), K)).copy()
    warm[3:] = warm[3:, :, ::-1]  # the same experts in another order are the same route
    write_csv(tmp_path / "prompt_1_data.csv", warm)  # a whole file of warm-up rows
    # a file whose batch 0 is warm-up (4 identical tokens) and batch 1 a real prompt
    mixed = np.concatenate([np.broadcast_to(real[1:2], (4, len(LAYERS), K)), real])
    write_csv(tmp_path / "prompt_2_data.csv", mixed, batches=[0] * 4 + [1] * 5)
    write_csv(tmp_path / "prompt_3_data.csv", real[:1])  # one token: nothing to compare, kept
    out = tmp_path / "trace"
    status = main(["trace", "import", str(tmp_path), "-o", str(out), "--n-expert", str(N_EXPERT)])
    captured = capsys.readouterr()
    assert status == 0
    assert "dropped 2 dummy batches (10 tokens)" in captured.err
    assert captured.out.startswith("imported 3 csv-ids files") and "2 dummy batches dropped" in captured.out
    reader, ids, _ = read_back(out)
    assert reader.sequences() == [(0, 5), (5, 6)]
    np.testing.assert_array_equal(ids, np.concatenate([real, real[:1]]))
    assert reader.meta.extra["dropped_tokens"] == 10


def test_a_shape_checks_the_rows_and_names_the_model(tmp_path: Path) -> None:
    shape = ModelShape("small-moe", n_layers=4, moe_layers=LAYERS, n_expert=N_EXPERT, top_k=K, n_embd=64)
    write_csv(tmp_path / "p.csv", routes(3, 0))
    import_recording([tmp_path / "p.csv"], tmp_path / "t", ImportOptions(shape=shape))
    meta = TraceReader(tmp_path / "t").meta
    assert (meta.model, meta.n_layers, meta.n_embd, meta.extra["shape"]) == ("small-moe", 4, 64, "small-moe")
    wider = ModelShape("wide", n_layers=4, moe_layers=LAYERS, n_expert=N_EXPERT, top_k=4)
    with pytest.raises(
        RecordingError, match=r"p\.csv:2: the rows select 2 experts per token, --shape wide says top-4"
    ):
        import_recording([tmp_path / "p.csv"], tmp_path / "t2", ImportOptions(shape=wider))
    deeper = ModelShape("dense-lead", n_layers=4, moe_layers=(2, 3), n_expert=N_EXPERT, top_k=K)
    with pytest.raises(RecordingError, match=r"layer 1 is not a MoE layer of dense-lead"):
        import_recording([tmp_path / "p.csv"], tmp_path / "t2", ImportOptions(shape=deeper))
    with pytest.raises(RecordingError, match=r"--n-expert says n_expert = 16, but --shape small-moe says 8"):
        import_recording([tmp_path / "p.csv"], tmp_path / "t2", ImportOptions(shape=shape, n_expert=16))
    assert not (tmp_path / "t2").exists()


def test_the_command_refuses_what_it_cannot_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_csv(tmp_path / "p.csv", routes(3, 0))
    assert main(["trace", "import", str(tmp_path / "p.csv"), "-o", str(tmp_path / "t")]) == 1
    assert "does not say how many experts the model has: give --n-expert N" in capsys.readouterr().err
    (tmp_path / "t").mkdir()
    args = ["trace", "import", str(tmp_path / "p.csv"), "-o", str(tmp_path / "t"), "--n-expert", "8"]
    assert main(args) == 1
    assert "already exists; remove it" in capsys.readouterr().err
    assert main(["trace", "import", str(tmp_path / "none.csv"), "-o", str(tmp_path / "u")]) == 1
    assert "none.csv: no such file or folder" in capsys.readouterr().err


def test_files_that_route_other_layers_or_another_k_are_refused(tmp_path: Path) -> None:
    write_csv(tmp_path / "prompt_1_data.csv", routes(3, 0))
    lines = (tmp_path / "prompt_1_data.csv").read_text().splitlines()
    (tmp_path / "prompt_2_data.csv").write_text("\n".join(lines[:1] + lines[4:]) + "\n")  # no layer 1
    wide = [lines[0], *(row.replace("]", ", 7]").replace("7, 7]", "6, 7]") for row in lines[1:])]
    (tmp_path / "prompt_3_data.csv").write_text("\n".join(wide) + "\n")
    with pytest.raises(
        RecordingError, match=r"prompt_2_data\.csv:2: the sequence routes 2 layers, that of .*"
    ):
        import_recording(
            [tmp_path / "prompt_1_data.csv", tmp_path / "prompt_2_data.csv"], tmp_path / "t", OPTIONS
        )
    with pytest.raises(
        RecordingError, match=r"prompt_3_data\.csv:2: the rows select 3 experts per token.*mixed k"
    ):
        import_recording(
            [tmp_path / "prompt_1_data.csv", tmp_path / "prompt_3_data.csv"], tmp_path / "t", OPTIONS
        )
    assert not (tmp_path / "t").exists()
