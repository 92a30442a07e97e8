"""What a GGUF tensor's name says about its role: the one place that spells the rule.

llama.cpp names a layer's tensors `blk.N.<role>.<part>` (src/llama-arch.cpp). The
routed experts are the tensors whose role ends in `_exps` (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, `ffn_gate_up_exps` where gate and up are merged,
`ffn_norm_exps`); each holds one slice per expert along its last ggml dimension,
and its parts may be more than the `weight` (`bias`, `scale`, `input_scale`). The
shared expert (`ffn_*_shexp`), the router (`ffn_gate_inp`) and the chunked experts
(`ffn_*_chexps`) are not routed experts.
"""

from __future__ import annotations

import re

# any tensor stored one slice per routed expert: what a routed expert's bytes are
_ROUTED_EXPERT = re.compile(r"^blk\.\d+\.ffn_[a-z_]+_exps\.[a-z_]+$")

# the three matrices the runtime moves, as llama.cpp's tensor-override regex sees a
# name (regex_search: the tail alone); EXPERT_TENSOR is the same tail with its layer
EXPERT_MATRIX_TAIL = r"\.ffn_(gate|up|down)_exps\.weight$"
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)" + EXPERT_MATRIX_TAIL)
SHARED_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight$")


def is_routed_expert(name: str) -> bool:
    """True for a tensor llama.cpp stores with one slice per routed expert
    (blk.N.ffn_*_exps.*); False for the shared expert, the router and the rest."""
    return _ROUTED_EXPERT.match(name) is not None
