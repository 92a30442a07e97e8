"""What `pyspice serve` does between SIGTERM (or Ctrl-C) and its exit.

uvicorn stops accepting at once and gives the requests in flight `--grace`
seconds before it cancels them. Cancelled mid-stream, an SSE answer just stops:
no final chunk, no `data: [DONE]`, and sse-starlette by default cancelled
every stream the moment the signal came. Here instead:

- streams are left to run (sse-starlette's automatic drain is off);
- a generation still running `stop_after_s` after the signal -- the grace less
  a margin for the last token and the answer's end -- is stopped between two
  tokens by a stopping criterion, so llama-cpp-python ends it as it ends any
  stopped answer: a final chunk with finish_reason "stop", then `[DONE]` (a
  plain request gets its complete JSON). Requests still queued start and stop
  at their first token the same way.

A single decode step longer than the margin (a very slow bus) is still cut by
uvicorn at the grace's end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Drain:
    grace_s: float
    started: float | None = None  # time.monotonic() of the signal

    @property
    def stop_after_s(self) -> float:
        """Seconds after the signal at which generations are stopped."""
        margin = min(2.0, self.grace_s / 4)
        return max(0.0, self.grace_s - margin)

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def stopping(self) -> bool:
        return self.started is not None and time.monotonic() - self.started >= self.stop_after_s

    def criterion(self, _input_ids: Any, _logits: Any) -> bool:
        """A llama-cpp-python stopping criterion (checked after each token)."""
        return self.stopping()


def keep_streams_through_shutdown() -> None:
    """sse-starlette cancels every stream the moment uvicorn sees the signal unless told
    not to (process-wide: the server is this process's one job)."""
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]


def draining_server(config: Any, drain: Drain) -> Any:
    """A uvicorn.Server that starts `drain` when it is told to exit."""
    import uvicorn

    class DrainingServer(uvicorn.Server):  # type: ignore[misc]
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain.start()
            super().handle_exit(sig, frame)

    return DrainingServer(config)
