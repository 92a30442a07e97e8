"""`pyspice serve`: an OpenAI-compatible HTTP server with pyspice placing the experts.

llama-cpp-python's server (its routes: `/v1/chat/completions`,
`/v1/completions` with streaming, `/v1/models`, tokenize, ...) serving a
`pyspice.Llama` with the chosen policy, plus `GET /spice/stats`: the stats
record since the server started. Needs the `serve` extra
(`pip install -e '.[serve]'`; `make venv` installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import signal
import socket
import sys
from typing import Any

from pyspice import __version__
from pyspice.cli import numbers
from pyspice.cli.common import (
    add_context_args,
    add_model_args,
    add_sidecar_arg,
    note,
    open_model,
    resolve_model,
)
from pyspice.cli.help_levels import advanced
from pyspice.cli.serve_drain import Drain, draining_server, keep_streams_through_shutdown
from pyspice.cli.serve_guard import DefaultMaxTokens, Guard, GuardConfig, check_messages, pydantic_validator

SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


def register(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (chat, completions, streaming)"
    )
    p.description = __doc__
    add_model_args(p)
    add_context_args(p)
    add_sidecar_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument(
        "--port", type=numbers.PORT, default=8000, help="listen port (default 8000; 0 picks a free one)"
    )
    advanced(
        p.add_argument("--alias", default=None, help="the model's name in the API (default: the file's name)")
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require this bearer token on every request, every route (docs and stats included)",
    )
    advanced(
        p.add_argument(
            "--max-queue",
            type=numbers.integer(0, hint="0: only the request generating"),
            default=4,
            help="requests that may wait behind the one generating; more get HTTP 503 (default 4)",
        )
    )
    advanced(
        p.add_argument(
            "--cors-origin",
            action="append",
            default=[],
            metavar="ORIGIN",
            help="allow browser requests from this origin (repeatable; default: CORS off)",
        )
    )
    advanced(
        p.add_argument(
            "--grace",
            type=numbers.real(0.0, hint="seconds"),
            default=10.0,
            help="on SIGTERM or Ctrl-C, seconds in-flight requests may take to finish (default 10)",
        )
    )
    p.set_defaults(func=run)
    return p


def check_server_deps() -> None:
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"pyspice serve needs the 'serve' extra ({', '.join(missing)} missing): "
            "pip install -e '.[serve]' (make venv installs it)"
        )


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=64)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is in use (another server?): pick another with --port"
            ) from None
        if exc.errno == errno.EACCES:
            raise ValueError(f"no permission to listen on {host}:{port}: use a port above 1024") from None
        if exc.errno in (errno.EADDRNOTAVAIL, socket.EAI_NONAME):
            raise ValueError(f"cannot listen on {host}: not an address of this machine") from None
        raise


def build_app(
    llm: Any,
    alias: str,
    host: str,
    port: int,
    api_key: str | None = None,
    *,
    max_queue: int = 4,
    cors_origins: tuple[str, ...] = (),
    drain: Drain | None = None,
) -> Any:
    """llama-cpp-python's FastAPI routes serving `llm` (already loaded), plus /spice/stats,
    behind pyspice's Guard (serve_guard: key, body, queue and error rules)."""
    # lazy: the server extra is optional (check_server_deps says what is missing)
    from fastapi import FastAPI
    from fastapi.middleware import Middleware
    from fastapi.middleware.cors import CORSMiddleware
    from llama_cpp.server import app as server_app
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from llama_cpp.server.types import (
        CreateChatCompletionRequest,
        CreateCompletionRequest,
        CreateEmbeddingRequest,
    )
    from starlette_context.middleware import RawContextMiddleware
    from starlette_context.plugins.request_id import RequestIdPlugin

    class LoadedModel(LlamaProxy):  # type: ignore[misc]
        """The proxy the routes ask for a model: always the one pyspice loaded."""

        def __init__(self, settings: ModelSettings) -> None:
            self._model_settings_dict = {alias: settings}
            # duck-typed: the routes only call methods, which it forwards to llm
            stop = drain.criterion if drain is not None else None
            self._current_model = DefaultMaxTokens(llm, stop=stop)  # type: ignore[assignment]
            self._current_model_alias = alias
            self._default_model_settings = settings
            self._default_model_alias = alias

        def free(self) -> None:
            pass  # the command closes the model after the server stops

    # interrupt_requests=False: upstream cuts a streaming answer short (its [DONE], no
    # finish_reason) whenever another request waits; here requests wait their turn in the
    # bounded queue (serve_guard), and a stream runs to its end
    server_app.set_server_settings(
        ServerSettings(host=host, port=port, api_key=api_key, interrupt_requests=False)
    )
    app = FastAPI(
        title="pyspice",
        version=__version__,
        middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
    )
    if cors_origins:  # off unless asked: any origin with credentials let any web page use the server
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_credentials=False,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    app.include_router(server_app.router)
    # The routes read the proxy from this module attribute; its setter, set_llama_proxy,
    # only takes settings and would load a second, plain llama_cpp.Llama.
    server_app._llama_proxy = LoadedModel(ModelSettings(model=str(llm.model_path), model_alias=alias))

    @app.get("/spice/stats")
    async def spice_stats() -> dict[str, Any]:
        # the inner lock waits for a running generation to finish; taking the outer
        # one would make llama-cpp-python interrupt a streaming answer
        async with server_app.llama_inner_lock:
            return dict(llm.spice_stats())

    guard = GuardConfig(
        api_key=api_key,
        max_queue=max_queue,
        cors_origins=cors_origins,
        validators={
            "/v1/completions": pydantic_validator(CreateCompletionRequest),
            "/v1/chat/completions": pydantic_validator(CreateChatCompletionRequest, check_messages),
            "/v1/embeddings": pydantic_validator(CreateEmbeddingRequest),
        },
    )
    return Guard(app, guard)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    check_server_deps()
    # lazy: the server extra is optional
    import uvicorn

    sock = listen(args.host, args.port)
    drain = Drain(args.grace)
    try:
        llm = open_model(args)
        port = sock.getsockname()[1]
        alias = args.alias or resolve_model(args).name
        app = build_app(
            llm,
            alias,
            args.host,
            port,
            args.api_key,
            max_queue=args.max_queue,
            cors_origins=tuple(args.cors_origin),
            drain=drain,
        )
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            # SIGTERM/Ctrl-C: stop accepting, let in-flight requests finish this long, then cancel
            timeout_graceful_shutdown=args.grace,
            timeout_keep_alive=5,  # an idle connection is closed after 5 s
            limit_concurrency=64,  # connections beyond this get 503 from uvicorn itself
        )
        # streams in flight at SIGTERM end with a final chunk and [DONE] within the grace
        keep_streams_through_shutdown()
        server = draining_server(config, drain)
        host = f"[{args.host}]" if ":" in args.host else args.host
        note(
            f"serving {alias} (policy {llm.spice_policy}) at http://{host}:{port}/v1 "
            f"(stats: /spice/stats); Ctrl-C stops"
        )
        sys.stderr.flush()
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then delivers the signal again
        # to the handler it found: make both end here as a clean stop
        signal.signal(signal.SIGTERM, _raise_interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
        llm.close()
        note("server stopped")
    finally:
        sock.close()
    return 0
