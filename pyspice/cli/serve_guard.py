"""What `pyspice serve` puts in front of llama-cpp-python's routes.

llama-cpp-python's app checks the API key only on its own routes (not on
/docs, /openapi.json or ours), answers malformed JSON and invalid fields with
HTTP 500 and a validation dump holding server file paths, reads any body
size, queues without bound, and lets a chat request without max_tokens run
to the context limit. `Guard` is one ASGI middleware, outermost, that every
request passes, in this order:

1. the API key: every route, none left open (the docs and schema describe
   the API to whoever may use it; the stats describe the machine's load);
   CORS preflights pass only when --cors-origin allows an origin, since a
   browser sends them without credentials;
2. the body: at most 1 MiB, read within a time limit (a slow client gets
   408), JSON that parses to an object, fields valid for the route (400 /
   422 with a JSON error naming the field, never a server path);
3. the queue: at most 1 generation running and `max_queue` waiting; beyond
   that 503 with Retry-After;
4. any 500 left is answered with a generic JSON error (the detail goes to
   the server's log, not to the client).

`DefaultMaxTokens` gives a request without max_tokens min(context left, 512),
and stops generations when the server drains (serve_drain.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 512
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None
    max_queue: int = 4  # requests waiting behind the one generating
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0  # to receive a whole request body
    cors_origins: tuple[str, ...] = ()
    validators: dict[str, Callable[[dict[str, Any]], None]] = field(default_factory=dict)


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


async def _send_json(
    send: Send, status: int, doc: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> None:
    body = json.dumps(doc).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def _error_doc(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def check_api_key(scope: Scope, api_key: str) -> bool:
    """The request carries `Authorization: Bearer <api_key>` (compared in constant time)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), api_key.encode()
            )
    return False


async def read_body(receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, refused past `limit` bytes or `timeout_s` seconds (a slow client)."""
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        left = deadline - loop.time()
        try:
            message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
        except TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {timeout_s:g} s") from None
        if message["type"] == "http.disconnect":
            raise RequestError(400, "the client went away before its request body arrived")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the request body is over {limit} bytes (the limit is 1 MiB)")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying where it stops being one."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise RequestError(400, f"the request body is not valid JSON{where}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, f"the request body must be a JSON object, not {type(doc).__name__}")
    return doc


def check_messages(doc: dict[str, Any]) -> None:
    """A chat request needs at least one message (upstream's model defaults to none,
    and `{}` then generated to the context limit)."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(422, "messages: a chat completion needs a non-empty list of messages")


def pydantic_validator(
    model: Any, *extra: Callable[[dict[str, Any]], None]
) -> Callable[[dict[str, Any]], None]:
    """A route's body check with llama-cpp-python's own request model; the errors
    name the field and the problem, and nothing of the server (no paths, no input echo)."""
    from pydantic import ValidationError

    def validate(doc: dict[str, Any]) -> None:
        for rule in extra:
            rule(doc)
        try:
            model(**doc)
        except ValidationError as exc:
            problems = [
                f"{'.'.join(str(p) for p in err.get('loc', ())) or 'body'}: {err.get('msg', 'invalid')}"
                for err in exc.errors(include_url=False, include_input=False)
            ]
            raise RequestError(422, "; ".join(problems[:8])) from None
        except TypeError as exc:  # a field name that is not an identifier
            raise RequestError(422, f"invalid field: {exc}") from None

    return validate


class Guard:
    """The ASGI middleware described in the module docstring."""

    def __init__(self, app: App, config: GuardConfig) -> None:
        self.app = app
        self.config = config
        self.admitted = 0  # generation requests running or waiting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self._guarded(scope, receive, send)
        except RequestError as exc:
            headers = [(b"retry-after", b"5")] if exc.status == 503 else []
            if exc.status == 401:
                headers.append((b"www-authenticate", b"Bearer"))
            await _send_json(send, exc.status, _error_doc(exc.message, exc.kind), headers)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        cfg = self.config
        preflight = scope["method"] == "OPTIONS" and bool(cfg.cors_origins)
        if cfg.api_key is not None and not preflight and not check_api_key(scope, cfg.api_key):
            raise RequestError(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "auth_error"
            )
        path = scope["path"]
        if scope["method"] == "POST":
            body = await read_body(receive, cfg.max_body_bytes, cfg.body_timeout_s)
            validate = cfg.validators.get(path)
            if validate is not None:
                doc = parse_json_object(body)
                validate(doc)
                if path == "/v1/completions" and "max_tokens" not in doc:
                    # the request model's default is 16; absent means "the server's default"
                    doc["max_tokens"] = None
                    body = json.dumps(doc).encode()
            receive = _replay(body, receive)
        if path in GENERATION_ROUTES:
            if self.admitted >= 1 + cfg.max_queue:
                raise RequestError(
                    503,
                    f"the server is busy ({self.admitted} requests running or queued); retry shortly",
                    "server_busy",
                )
            self.admitted += 1
            try:
                await self.app(scope, receive, _hide_server_errors(send))
            finally:
                self.admitted -= 1
            return
        await self.app(scope, receive, _hide_server_errors(send))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the client's later messages
    (the disconnect a streaming route listens for)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _hide_server_errors(send: Send) -> Send:
    """Replace a 500's body by a generic JSON error: llama-cpp-python puts the
    exception text there, file paths included; the server's log keeps it."""
    hiding = False

    async def guarded(message: Message) -> None:
        nonlocal hiding
        if message["type"] == "http.response.start" and message["status"] >= 500:
            hiding = True
            body = json.dumps(
                _error_doc("internal server error (details are in the server log)", "server_error")
            )
            data = body.encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            await send({"type": "http.response.start", "status": message["status"], "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return
        if hiding:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                print("pyspice: serve: a request failed with a server error (see above)", file=sys.stderr)
            return
        await send(message)

    return guarded


class DefaultMaxTokens:
    """The served model, but a completion without max_tokens gets min(context left, cap)
    (upstream: chat ran to the context limit), and `stop` (a llama-cpp-python stopping
    criterion: the server's drain after SIGTERM) joins every completion's criteria.
    Everything else is the model's own."""

    def __init__(
        self, llm: Any, cap: int = DEFAULT_MAX_TOKENS, stop: Callable[[Any, Any], bool] | None = None
    ) -> None:
        self._llm = llm
        self._cap = cap
        self._stop = stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def create_completion(self, prompt: Any = "", *args: Any, **kwargs: Any) -> Any:
        if not args and kwargs.get("max_tokens") is None:
            if isinstance(prompt, str):
                n_prompt = len(self._llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True))
            else:
                n_prompt = len(prompt)
            # at least 1: a prompt that fills the context gets upstream's clear 400
            kwargs["max_tokens"] = max(1, min(self._llm.n_ctx() - n_prompt, self._cap))
        if self._stop is not None and not args:
            import llama_cpp

            given = kwargs.get("stopping_criteria") or []
            kwargs["stopping_criteria"] = llama_cpp.StoppingCriteriaList([*given, self._stop])
        return self._llm.create_completion(prompt, *args, **kwargs)

    def __call__(self, prompt: Any = "", *args: Any, **kwargs: Any) -> Any:
        return self.create_completion(prompt, *args, **kwargs)

    def create_chat_completion(self, *args: Any, **kwargs: Any) -> Any:
        # upstream's method run on this object, so its chat handler calls our create_completion
        import llama_cpp

        return llama_cpp.Llama.create_chat_completion(self, *args, **kwargs)  # type: ignore[arg-type]
