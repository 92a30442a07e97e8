"""Runtime: libspice attached to one llama_context, and the hook callback that hands a
Python policy each MoE layer's HookCall and writes its plan back.

Runtime is put together from one part per concern, each a RuntimeHandle (handle.py: the
spice_runtime itself, its errors, layers, counters and abort flags):

- hook_calls.py: the HookCall of a hook call, cached per layer, its fields copied out
- plan_writer.py: the policy's Plan written back into the call
- fallback.py: a failing policy or a rejected plan runs that call exactly, warned once
- device_tier.py, surrogates.py, routing_replay.py: what the hook calls run with

This module holds what ties them to a policy: registering the hook, and the callback."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pyspice.policy.base import Policy, policy_reads, policy_reads_next_logits
from pyspice.policy.rule import Rule
from pyspice.runtime.device_tier import DeviceTier
from pyspice.runtime.fallback import ExactFallback
from pyspice.runtime.hook_calls import HookCalls
from pyspice.runtime.plan_writer import PlanWriter
from pyspice.runtime.plans import _rule_to_c
from pyspice.runtime.routing_replay import RoutingReplay
from pyspice.runtime.store import AsyncParams
from pyspice.runtime.surrogates import Surrogates

# spice_policy_fn return values (SPICE_POLICY_* in spice.h; test_cffi_declarations checks them):
# module constants because the callback runs on the hook's thread 0 per call
_POLICY_OK, _POLICY_FAILED, _POLICY_ABORT = 0, 1, 2


class Runtime(HookCalls, PlanWriter, ExactFallback, DeviceTier, Surrogates, RoutingReplay):
    """libspice attached to one llama_context.

    Create it with the context's address (`llama_cpp.Llama._ctx.ctx`); then
    `enable_exact()` or `enable_policy(policy)`, and `disable()` to get
    upstream's graph back. `close()` (or garbage collection) frees it.
    """

    def __init__(self, ctx_address: int) -> None:
        super().__init__(ctx_address)
        self._callback: Any = None
        self._policy: Policy | None = None
        self._async = False

    def close(self) -> None:
        if self._rt is not None:
            super().close()
            self._callback = None
            self._calls.clear()

    # ---- policies ------------------------------------------------------------------

    def set_rule(self, rule: Rule | None) -> None:
        """Install the per-activation rule the engine plans the calls no policy decides
        by (None: the default rule). Needs a device tier; a new tier starts with the
        default rule."""
        ffi = self._n.ffi
        layers = self.layers()
        n_expert = [info.n_expert if info.is_moe else 0 for info in layers]
        c_rule, keep = _rule_to_c(ffi, rule, n_expert) if rule is not None else (ffi.NULL, ())
        status = self._n.lib.spice_runtime_set_rule(self._rt, c_rule)
        del keep  # copied by libspice
        self._check(status, "set_rule")

    def enable_exact(self, max_tokens: int = 0) -> None:
        """Register the hook with libspice's built-in exact policy (no Python per layer)."""
        self._check(self._n.lib.spice_runtime_disable(self._rt), "disable")  # a planner joined first
        self._policy = None
        self._callback = None
        self._check(
            self._n.lib.spice_runtime_enable(self._rt, self._n.ffi.NULL, self._n.ffi.NULL, max_tokens),
            "enable",
        )

    def enable_policy(
        self, policy: Policy, max_tokens: int = 0, asynchronous: AsyncParams | None = None
    ) -> None:
        """Register the hook with a Python policy called once per MoE layer: on the
        hook's thread, or with `asynchronous` on libspice's planner thread while the
        installed rule (set_rule) runs each call at once."""
        ffi = self._n.ffi
        # joins a planner thread first: it may be inside the old callback, which reads
        # self._policy and must outlive it
        self._check(self._n.lib.spice_runtime_disable(self._rt), "disable")
        self._policy = policy
        self._new_policy_warnings()
        self._async = asynchronous is not None
        self._calls.clear()  # a snapshot's arrays are not the graph's
        self._callback = ffi.callback(
            "int(spice_policy_call *, void *)", self._on_call, onerror=self._on_callback_error
        )
        lib = self._n.lib
        # the hook is handed only what the policy reads (each input is a copy per layer on a GPU)
        probs, shared = policy_reads(policy)
        if asynchronous is not None:
            probs, shared = probs or asynchronous.with_probs, shared or asynchronous.with_shared
        # the next layer's logits are the graph's, read where they are: on the hook's thread only
        # (a snapshot for the planner carries none, so an asynchronous policy reads None)
        nxt = policy_reads_next_logits(policy)
        self._unrequested = frozenset(i for i, wanted in ((1, probs), (4, shared), (6, nxt)) if not wanted)
        if asynchronous is None:
            flags = (
                (lib.SPICE_HOOK_WANT_PROBS if probs else 0)
                | (lib.SPICE_HOOK_WANT_SHEXP if shared else 0)
                | (lib.SPICE_HOOK_WANT_NEXT_LOGITS if nxt else 0)
            )
            status = lib.spice_runtime_enable_ex(self._rt, self._callback, ffi.NULL, max_tokens, flags)
            self._check(status, "enable")
        else:
            params = replace(asynchronous, with_probs=probs, with_shared=shared)
            status = lib.spice_runtime_enable_async(
                self._rt, self._callback, ffi.NULL, max_tokens, params.to_c(ffi)
            )
            self._check(status, "enable_async")

    def hook_flags(self) -> int:
        """SPICE_HOOK_WANT_* the hook is registered with (1 probs, 2 shared-expert output;
        libspice adds 2 while surrogates are loaded); 0 when it is not registered."""
        return int(self._n.lib.spice_runtime_hook_flags(self._rt))

    def sync_hook(self) -> None:
        """Between decodes: re-register the hook where the graph inputs the runtime needs
        changed (a plan installed a rule during the last decode; spice_runtime_sync_hook)."""
        self._n.lib.spice_runtime_sync_hook(self._rt)

    def is_async(self) -> bool:
        """Whether the policy plans on libspice's planner thread."""
        return bool(self._n.lib.spice_runtime_is_async(self._rt))

    def disable(self) -> None:
        """Unregister the hook: the context runs upstream's graph again."""
        self._check(self._n.lib.spice_runtime_disable(self._rt), "disable")
        self._policy = None
        self._callback = None

    def keep_debug_log(self, keep: bool = True) -> None:
        """Let llama.cpp's debug log lines through to its log callback (a verbose model).
        By default the runtime drops them in C: ggml-cuda logs one per CUDA graph it
        replays, and llama-cpp-python's Python callback made each such launch take the
        GIL (spice_runtime_keep_debug_log in spice.h)."""
        self._check(self._n.lib.spice_runtime_keep_debug_log(self._rt, int(keep)), "keep_debug_log")

    # Failure rules (docs/design.md section 6): a policy's `Exception` or an invalid plan
    # runs that call exactly and is reported once; `KeyboardInterrupt` asks the
    # runtime to abort the running llama_decode and is re-raised by the API layer.
    def _on_call(self, call: Any, _user_data: Any) -> int:
        """cffi callback on graph thread 0: find the views, ask the policy, write the plan."""
        try:
            policy = self._policy
            assert policy is not None
            view = self._hook_call(call)
            try:
                plan = policy.decide(view)
            finally:
                view.close()  # a HookCall read after decide raises
            self._write_plan(call, view, plan)
            return _POLICY_OK
        except KeyboardInterrupt:
            self._interrupted = True
            return _POLICY_ABORT
        except Exception as exc:  # a policy bug must never crash the host process
            self._policy_failed(self._policy, exc, self._async)
            return _POLICY_FAILED
        except BaseException:
            self._interrupted = True
            return _POLICY_ABORT

    def _on_callback_error(self, exc_type: Any, exc: Any, _tb: Any) -> int:
        """What cffi calls when an exception escapes `_on_call` itself (a Ctrl-C that
        lands before its try block runs): abort the decode instead of cffi's
        "Exception ignored" and decoding on."""
        self._interrupted = True
        return _POLICY_ABORT
