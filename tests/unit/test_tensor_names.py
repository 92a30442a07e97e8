"""One rule for "is this a routed expert tensor" (pyspice.formats.tensor_names), and the
modules that used to spell it themselves now asking it."""

from __future__ import annotations

import pytest

from pyspice.formats.tensor_names import EXPERT_TENSOR, is_routed_expert
from pyspice.models.synth import shape_for, tensor_plan


@pytest.mark.parametrize(
    "name",
    [
        "blk.3.ffn_up_exps.weight",
        "blk.3.ffn_gate_exps.weight",
        "blk.0.ffn_down_exps.weight",
        "blk.12.ffn_gate_up_exps.weight",  # gate and up merged
        "blk.3.ffn_gate_exps.bias",
        "blk.3.ffn_down_exps.scale",
        "blk.3.ffn_up_exps.input_scale",
    ],
)
def test_routed_expert_tensors(name: str) -> None:
    assert is_routed_expert(name)


@pytest.mark.parametrize(
    "name",
    [
        "blk.3.ffn_up_shexp.weight",  # the shared expert
        "blk.3.ffn_gate_inp.weight",  # the router
        "blk.3.ffn_gate_inp_shexp.weight",
        "blk.3.ffn_up.weight",  # a dense layer's FFN
        "blk.3.ffn_gate_chexps.weight",  # chunked experts: not llama.cpp's routed ones
        "blk.3.exp_probs_b.bias",
        "blk.3.attn_q.weight",
        "token_embd.weight",
        "output.weight",
        "ffn_up_exps.weight",  # no layer
        "blk.x.ffn_up_exps.weight",
    ],
)
def test_not_routed_expert_tensors(name: str) -> None:
    assert not is_routed_expert(name)


def test_the_three_matrices_are_routed_experts() -> None:
    for part in ("gate", "up", "down"):
        name = f"blk.7.ffn_{part}_exps.weight"
        m = EXPERT_TENSOR.match(name)
        assert m is not None and m.groups() == ("7", part)
        assert is_routed_expert(name)
    assert EXPERT_TENSOR.match("blk.7.ffn_gate_exps.bias") is None


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_synth_plan_marks_exactly_the_routed_experts(arch: str) -> None:
    plan = tensor_plan(arch, shape_for(arch, "tiny"), 32000)
    routed = {t.name for t in plan if t.routed_experts}
    assert routed == {t.name for t in plan if EXPERT_TENSOR.match(t.name)}
    assert routed and not any("shexp" in n or "gate_inp" in n for n in routed)
