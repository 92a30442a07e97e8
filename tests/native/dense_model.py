"""A tiny dense (non-MoE) llama GGUF: the hook must refuse it clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from pyspice.build_info import load_build_info
from pyspice.models.synth import read_vocab

N_EMBD, N_FF, N_HEAD = 64, 128, 2


def write_dense_llama(path: Path) -> Path:
    tokenizer, n_vocab = read_vocab(load_build_info().vocab("llama-spm"))
    rng = np.random.default_rng(0)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    writer = GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(1)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    for kv in tokenizer:
        writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    writer.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", mat(n_vocab, N_EMBD))
    p = "blk.0."
    writer.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(p + name + ".weight", mat(N_EMBD, N_EMBD))
    writer.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor(p + "ffn_gate.weight", mat(N_FF, N_EMBD))
    writer.add_tensor(p + "ffn_up.weight", mat(N_FF, N_EMBD))
    writer.add_tensor(p + "ffn_down.weight", mat(N_EMBD, N_FF))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
