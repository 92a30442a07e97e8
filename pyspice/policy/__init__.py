"""Policies: pure Python/numpy decisions over plain data.

A policy sees one hook call (`HookCall`: the layer, the MoE input, router
probabilities, selected experts and their gate weights, the shared-expert
output) and returns a `Plan` (an action per (token, selected expert) and
lists of experts to fetch, prefetch and evict). The same policy objects run
under the real engine and under the simulator.

This package never imports native code.
"""

from pyspice.policy.base import (
    ACTION_DEVICE,
    ACTION_DROP,
    ACTION_HOST,
    ACTION_NAMES,
    ACTION_SURROGATE,
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
    HookCall,
    HookInputError,
    Plan,
    Policy,
    policy_reads,
    policy_reads_next_logits,
)
from pyspice.policy.context import PolicyContext
from pyspice.policy.registry import NATIVE_POLICIES, PolicySpec, make_policy, policy_names, policy_spec
from pyspice.policy.rule import Rule, RulePolicy, declared_rule

__all__ = [
    "ACTION_DEVICE",
    "ACTION_DROP",
    "ACTION_HOST",
    "ACTION_NAMES",
    "ACTION_SURROGATE",
    "NATIVE_POLICIES",
    "RESIDENCY_ABSENT",
    "RESIDENCY_COPYING",
    "RESIDENCY_QUEUED",
    "RESIDENCY_RESIDENT",
    "HookCall",
    "HookInputError",
    "Plan",
    "Policy",
    "PolicyContext",
    "PolicySpec",
    "Rule",
    "RulePolicy",
    "declared_rule",
    "make_policy",
    "policy_names",
    "policy_reads",
    "policy_reads_next_logits",
    "policy_spec",
]
