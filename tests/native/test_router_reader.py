"""RouterReader (pyspice.formats.routers) reads each MoE layer's router from the
file with pyspice's own header parser; what it returns is gguf's own
dequantization of the same bytes, for plain and quantized routers of both
architectures, and None for a layer without a router."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyspice.formats.routers import RouterReader


@pytest.mark.parametrize(
    "arch,shape,quant",
    [
        ("qwen2moe", "tiny", None),
        ("qwen2moe", "tiny-odd", "Q4_K"),
        ("deepseek2", "tiny", "Q5_K_M"),
        ("deepseek2", "tiny", "Q8_0"),
    ],
)
def test_routers_are_gguf_s_dequantization_of_the_file(
    synth_model, arch: str, shape: str, quant: str
) -> None:
    path = synth_model(arch, shape, quant)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    reader = RouterReader(path)
    n_layers = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))
    seen = 0
    for il in range(n_layers):
        t = tensors.get(f"blk.{il}.ffn_gate_inp.weight")
        got = reader(il)
        if t is None:
            assert got is None, f"layer {il} has no router"
            continue
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        assert got is not None and got.dtype == np.float32
        assert got.shape == (int(t.shape[1]), int(t.shape[0]))
        assert np.array_equal(got, want.reshape(got.shape)), f"layer {il}"
        assert reader(il) is got  # read once, then cached
        seen += 1
    assert seen > 0
