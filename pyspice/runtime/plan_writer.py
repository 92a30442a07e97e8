"""A policy's Plan written back into the hook call it answers: its actions, the lists of
experts to fetch, prefetch and evict, and its Rule, which libspice then checks and runs."""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np

from pyspice.policy.base import HookCall, Plan
from pyspice.policy.rule import Rule
from pyspice.runtime.handle import RuntimeHandle
from pyspice.runtime.plans import _copy_ints, _rule_to_c, _write_actions

_INT32 = np.dtype(np.int32)
_MAX_CACHED_RULES = 80  # above the deepest plan ring (deterministic lag 64 + 2)


class PlanWriter(RuntimeHandle):
    """The writing of a Runtime's plans into libspice's hook calls."""

    def __init__(self, ctx_address: int) -> None:
        super().__init__(ctx_address)
        self._rules: dict[int, tuple[Rule, Any, tuple[Any, ...]]] = {}  # see _plan_rule

    def _write_plan(self, call: Any, view: HookCall, plan: Plan) -> None:
        actions = plan.actions
        if actions is not None:
            n, used = view.n_tokens, view.n_expert_used
            # the common shapes first: a decode step's one row as a list (cffi converts and
            # range-checks each int in C), or an int32 array of the right shape
            if (
                isinstance(actions, list)
                and n == 1
                and len(actions) == 1
                and isinstance(actions[0], list)
                and len(actions[0]) == used
            ):
                try:
                    call.actions[0:used] = actions[0]
                except (TypeError, OverflowError):
                    _write_actions(self._n.ffi, call, actions, (n, used))
            elif (
                type(actions) is np.ndarray
                and actions.dtype == _INT32
                and actions.shape == (n, used)
                and actions.flags.c_contiguous
            ):
                self._n.ffi.memmove(call.actions, actions, actions.nbytes)
            else:
                _write_actions(self._n.ffi, call, actions, (n, used))
            call.n_actions = n * used
        # libspice zeroes the counts before each call, so empty lists cost nothing
        if plan.fetch:
            call.n_fetch = _copy_ints(self._n.ffi, call.fetch, call.cap_fetch, plan.fetch)
        if plan.prefetch:
            pairs = list(chain.from_iterable(plan.prefetch))
            call.n_prefetch = _copy_ints(self._n.ffi, call.prefetch, call.cap_prefetch, pairs)
        if plan.evict:
            pairs = list(chain.from_iterable(plan.evict))
            call.n_evict = _copy_ints(self._n.ffi, call.evict, call.cap_evict, pairs)
        if plan.evict_from:
            call.n_evict_from = _copy_ints(self._n.ffi, call.evict_from, call.cap_evict_from, plan.evict_from)
        if plan.resume_layer != -1:
            call.resume_il = plan.resume_layer
        if plan.rule is not None:
            if not isinstance(plan.rule, Rule):
                raise TypeError(f"plan.rule must be a pyspice.policy.Rule, got {type(plan.rule).__name__}")
            call.rule = self._plan_rule(plan.rule)

    def _plan_rule(self, rule: Rule) -> Any:
        """The spice_rule of a plan's Rule, converted once per Rule object and kept alive
        (with the arrays it points into) while cached: an asynchronous plan is applied
        calls after it was written, and the same object gives the same address, which
        libspice does not install again."""
        key = id(rule)
        hit = self._rules.get(key)
        if hit is not None and hit[0] is rule:
            return hit[1]
        if len(self._rules) >= _MAX_CACHED_RULES:  # more than any ring of plans holds
            self._rules.pop(next(iter(self._rules)))
        n_expert = [info.n_expert if info.is_moe else 0 for info in self.layers()]
        c_rule, keep = _rule_to_c(self._n.ffi, rule, n_expert)
        self._rules[key] = (rule, c_rule, keep)
        return c_rule
