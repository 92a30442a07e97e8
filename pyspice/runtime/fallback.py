"""What a Runtime does when a policy fails it (docs/design.md section 6): a policy that
raises, or a plan libspice rejects, costs that call its plan, never the decode. The call
runs exactly instead (asynchronously: by the policy's rule), and the user is told once per
policy, not once per layer of every token."""

from __future__ import annotations

import sys

from pyspice.policy.base import Policy
from pyspice.runtime.handle import RuntimeHandle


class ExactFallback(RuntimeHandle):
    """A Runtime's one-time warnings of a policy's failures."""

    def __init__(self, ctx_address: int) -> None:
        super().__init__(ctx_address)
        self._policy_error: str | None = None
        self._warned_rejection = False
        self._rejections_seen = 0

    def _new_policy_warnings(self) -> None:
        """Each policy gets its own one-time warnings."""
        self._policy_error = None
        self._warned_rejection = False

    def _policy_failed(self, policy: Policy | None, exc: Exception, asynchronous: bool) -> None:
        """`policy` raised `exc` in a hook call, which runs without its plan: warn, the first time."""
        if self._policy_error is None:
            self._policy_error = f"{type(exc).__name__}: {exc}"
            instead = (
                "dropping its plan on the planner thread; the calls run by the policy's rule"
                if asynchronous
                else "running that call exactly"
            )
            print(
                f"pyspice: policy {getattr(policy, 'name', '?')!r} raised {self._policy_error}; "
                f"{instead} (warned once)",
                file=sys.stderr,
            )

    def report_rejections(self) -> None:
        """Warn once when libspice rejected a plan (the message names the problem)."""
        n = int(self._n.lib.spice_runtime_plan_rejections(self._rt))
        if n > self._rejections_seen and not self._warned_rejection and self._policy_error is None:
            print(
                f"pyspice: a plan was rejected ({self.last_error()}); ran that call exactly (warned once)",
                file=sys.stderr,
            )
            self._warned_rejection = True
        self._rejections_seen = n
