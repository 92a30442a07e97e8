"""formats.gguf_checks.check_container: what ggml's own GGUF reader (gguf.cpp) refuses,
refused by read_header first with a line naming the file, the field and the fix.
Before the rule, read_header passed each of these files and llama.cpp then refused
it behind llama-cpp-python's bare "Failed to load model from file" (the differential
fuzz harness's commonest refusals, docs/results/fuzzing.md)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyspice.formats.model_info import ModelFileError, read_header
from tests.unit.test_gguf_checks import write_model

U32 = gguf.GGUFValueType.UINT32
Q = gguf.GGMLQuantizationType


def _patch(path: Path, old: bytes, new: bytes) -> Path:
    data = path.read_bytes()
    assert data.count(old) == 1, f"{old!r} must appear once to patch it"
    path.write_bytes(data.replace(old, new))
    return path


def _tensor_entry(data: bytes, name: str) -> int:
    """Where `name`'s directory entry continues after the name (n_dims, dims, type, offset)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key)
    assert data.count(key) == 1
    return at + len(key)


def _set_tensor_field(path: Path, name: str, field: str, value: int) -> Path:
    data = bytearray(path.read_bytes())
    at = _tensor_entry(bytes(data), name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if field == "ne0":
        struct.pack_into("<Q", data, at + 4, value)
    else:  # the offset, after the dims and the type
        struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, value)
    path.write_bytes(bytes(data))
    return path


def _offset(path: Path, name: str) -> int:
    return next(t.offset for t in read_header(path).tensors if t.name == name)


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (4, "GGUF version 4, .* reads versions 2 and 3; it is newer .* update pyspice"),
        (1, "GGUF version 1, .* too old: convert the model again"),
        (0x03000000, "GGUF version 50331648, .* other byte order"),
    ],
)
def test_a_gguf_version_llama_cpp_does_not_read_is_refused(
    tmp_path: Path, version: int, message: str
) -> None:
    path = write_model(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 4, version)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=message):
        read_header(path)


def test_a_repeated_metadata_key_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", set_kv={"test.aaaa": (1, U32), "test.bbbb": (2, U32)})
    read_header(path)
    _patch(path, b"test.bbbb", b"test.aaaa")
    with pytest.raises(ModelFileError, match=r"metadata key test\.aaaa appears twice"):
        read_header(path)


def test_an_empty_metadata_key_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", set_kv={"": (1, U32)})
    with pytest.raises(ModelFileError, match="a metadata key is empty"):
        read_header(path)


def test_a_repeated_tensor_name_is_refused(tmp_path: Path) -> None:
    path = _patch(write_model(tmp_path / "m.gguf"), b"blk.2.ffn_up_exps.weight", b"blk.1.ffn_up_exps.weight")
    with pytest.raises(ModelFileError, match=r"tensor blk\.1\.ffn_up_exps\.weight appears twice"):
        read_header(path)


def test_a_tensor_name_of_ggml_max_name_bytes_is_refused(tmp_path: Path) -> None:
    # the container is checked before any model rule: a file of one tensor shows it
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, "qwen2moe")
    w.add_tensor("x" * 64, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"is empty or 64 bytes or longer \(ggml holds at most 63"):
        read_header(path)


def test_tensor_data_out_of_directory_order_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf")
    at = _offset(path, "output.weight")
    _set_tensor_field(path, "output.weight", "offset", at + 32)  # still aligned: only the order is wrong
    with pytest.raises(ModelFileError, match=f"output.weight's data is at offset {at + 32} .* end at {at}"):
        read_header(path)


def test_a_row_that_is_not_whole_quant_blocks_is_refused(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", types={"output.weight": Q.Q8_0})
    read_header(path)
    _set_tensor_field(path, "output.weight", "ne0", 48)  # the same number of whole blocks: the size holds
    with pytest.raises(ModelFileError, match="rows of 48 values, not a whole number of its 32-value blocks"):
        read_header(path)


def test_dimensions_that_multiply_past_int64_around_a_zero_are_refused(tmp_path: Path) -> None:
    """(2**61 + 16, 0, 4): gguf.cpp's overflow check multiplies by the 0 and passes it,
    ggml_new_tensor skips the 0 and aborts (GGML_ASSERT(INT64_MAX / ne[i] > ...), found by
    the differential fuzzer)."""
    path = write_model(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    at = _tensor_entry(bytes(data), "blk.1.ffn_down_exps.weight")
    struct.pack_into("<QQ", data, at + 4, 2**61 + 16, 0)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"shape \[2305843009213693968, 0, 4\], whose dimensions"):
        read_header(path)
