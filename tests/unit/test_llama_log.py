"""engine.llama_log.error_reason: llama.cpp's error log as the one line a user reads."""

from __future__ import annotations

from pyspice.engine.llama_log import MAX_REASON_CHARS, error_reason


def test_the_specific_reason_is_kept_and_the_generic_lines_dropped() -> None:
    pieces = [
        "gguf_init_from_file_impl: tensor 'a' has offset 64, expected 32\n",
        "gguf_init_from_file_impl: failed to read tensor data\n",
        "llama_model_load: error loading model: llama_model_loader: failed to load model from /m.gguf\n",
        "llama_model_load_from_file_impl: failed to load model\n",
    ]
    assert error_reason(pieces) == "tensor 'a' has offset 64, expected 32"


def test_prefixes_go_and_each_line_is_said_once() -> None:
    pieces = ["llama_model_load: error loading model: check_tensor_dims: tensor 'x' not found\n"] * 2
    assert error_reason(pieces) == "tensor 'x' not found"


def test_a_line_split_across_pieces_is_one_line() -> None:
    assert error_reason(["llama_init_from_model: n_ctx_per_seq (64) ", "> n_ctx_train (32)\n"]) == (
        "n_ctx_per_seq (64) > n_ctx_train (32)"
    )


def test_only_generic_lines_are_kept_rather_than_nothing() -> None:
    assert error_reason(["llama_model_load_from_file_impl: failed to load model\n"]) == "failed to load model"
    assert error_reason([]) == ""


def test_a_long_reason_is_cut() -> None:
    reason = error_reason([f"f: reason {i}\n" for i in range(200)])
    assert len(reason) == MAX_REASON_CHARS and reason.endswith("...")
