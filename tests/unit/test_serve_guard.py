"""pyspice serve's Guard (cli/serve_guard.py) driven as an ASGI app in-process: the key on
every route, 4xx JSON errors without server paths, the 1 MiB body limit, the bounded
queue, generic 500s, and the default max_tokens."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

from pyspice.cli.serve_drain import Drain
from pyspice.cli.serve_guard import (
    DefaultMaxTokens,
    Guard,
    GuardConfig,
    Message,
    Receive,
    Scope,
    Send,
    check_messages,
    pydantic_validator,
)


class Inner:
    """Stands for llama-cpp-python's app: echoes the body it got; /slow waits on an event;
    /boom answers 500 with a server path, as upstream's error handler does."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        if scope["method"] == "POST":
            body = (await receive())["body"]
            self.bodies.append(body)
        if scope["path"] == "/v1/completions" and b'"slow"' in body:
            await self.release.wait()
        status, out = (
            (500, b'{"error": {"message": "File \\"/srv/app.py\\", line 264"}}')
            if scope["path"] == "/boom"
            else (200, b'{"ok": true}')
        )
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": out})


def guard(inner: Inner, **config: Any) -> Guard:
    validators = {
        "/v1/completions": lambda doc: None,
        "/v1/chat/completions": pydantic_validator(CreateChatCompletionRequest, check_messages),
        "/v1/strict": pydantic_validator(CreateCompletionRequest),
    }
    return Guard(inner, GuardConfig(validators=validators, **config))  # type: ignore[arg-type]


async def call(
    app: Guard, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)] or [b""]
    queue = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    data = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(data)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize("path", ["/spice/stats", "/docs", "/openapi.json", "/v1/models", "/v1/completions"])
def test_the_api_key_covers_every_route(path: str) -> None:
    """Row 69: /spice/stats, /docs and /openapi.json answered without the key."""
    app = guard(Inner(), api_key="s3cret")
    method = "POST" if path == "/v1/completions" else "GET"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        status, head, doc = run(call(app, method, path, b"{}", headers))
        assert status == 401 and doc["error"]["type"] == "auth_error" and head["www-authenticate"] == "Bearer"
    status, _, _ = run(call(app, method, path, b"{}", {"Authorization": "Bearer s3cret"}))
    assert status == 200


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b'{"messages": [', 400, "not valid JSON at line 1"),  # row 61: was a 500
        (b"\xff\xfe", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object, not list"),
        (b"{}", 422, "messages: a chat completion needs a non-empty list"),  # row 62: generated 508 tokens
        (b'{"messages": [{"role": "alien", "content": "x"}]}', 422, "messages.0"),  # row 63: a 500 with paths
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "lots"}', 422, "max_tokens"),
    ],
)
def test_bad_bodies_are_4xx_json_without_server_paths(body: bytes, status: int, words: str) -> None:
    got, head, doc = run(call(guard(Inner()), "POST", "/v1/chat/completions", body))
    assert got == status and head["content-type"] == "application/json"
    message = doc["error"]["message"]
    assert words in message, message
    assert ".py" not in message and "Traceback" not in message


def test_a_body_over_1_mib_is_413() -> None:
    inner = Inner()
    status, _, doc = run(
        call(guard(inner), "POST", "/v1/completions", b'{"prompt": "' + b"x" * (1 << 20) + b'"}')
    )
    assert status == 413 and "1 MiB" in doc["error"]["message"] and inner.bodies == []


def test_a_server_error_is_generic() -> None:
    status, _, doc = run(call(guard(Inner()), "GET", "/boom"))
    assert status == 500 and "server log" in doc["error"]["message"] and ".py" not in json.dumps(doc)


def test_an_absent_max_tokens_becomes_the_servers_default() -> None:
    """The request model's default (16) must not stand in for 'absent'."""
    inner = Inner()
    run(call(guard(inner), "POST", "/v1/completions", b'{"prompt": "hi"}'))
    run(call(guard(inner), "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 7}'))
    assert [json.loads(b).get("max_tokens", "absent") for b in inner.bodies] == [None, 7]


def test_the_queue_is_bounded_and_answers_503() -> None:
    async def scenario() -> list[int]:
        inner = Inner()
        app = guard(inner, max_queue=2)
        slow = [asyncio.create_task(call(app, "POST", "/v1/completions", b'{"slow": 1}')) for _ in range(3)]
        await asyncio.sleep(0.05)
        status, head, doc = await call(app, "POST", "/v1/completions", b'{"prompt": "x"}')
        assert head["retry-after"] == "5" and "busy" in doc["error"]["message"]
        other, _, _ = await call(app, "GET", "/v1/models")  # not a generation: not queued
        inner.release.set()
        done = [s for s, _, _ in await asyncio.gather(*slow)]
        after, _, _ = await call(app, "POST", "/v1/completions", b'{"prompt": "x"}')
        return [status, other, *done, after]

    assert run(scenario()) == [503, 200, 200, 200, 200, 200]


class FakeLlm:
    def __init__(self, n_ctx: int) -> None:
        self._n_ctx = n_ctx
        self.asked: list[int] = []

    def n_ctx(self) -> int:
        return self._n_ctx

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return [1] * (len(text.split()) + int(add_bos))

    def create_completion(self, prompt: Any, **kwargs: Any) -> int:
        self.asked.append(kwargs["max_tokens"])
        return int(kwargs["max_tokens"])


def test_default_max_tokens_is_the_context_left_up_to_512() -> None:
    llm = FakeLlm(n_ctx=600)
    served = DefaultMaxTokens(llm)
    assert served.create_completion("one two three") == 512  # 600 - 4 left: capped
    assert served.create_completion(" ".join(["w"] * 299)) == 300  # 600 - 300 left
    assert served.create_completion([1] * 600) == 1  # full: upstream then says the context is exceeded
    assert served(prompt="a b", max_tokens=5) == 5  # given: kept
    assert served.n_ctx() == 600  # everything else is the model's


class KeepsCriteria(FakeLlm):
    def create_completion(self, prompt: Any, **kwargs: Any) -> Any:
        return kwargs.get("stopping_criteria")


def test_the_drain_stops_generations_near_the_end_of_the_grace_not_before_the_signal() -> None:
    drain = Drain(grace_s=10.0)
    assert drain.stop_after_s == 8.0 and Drain(grace_s=2.0).stop_after_s == 1.5
    assert Drain(grace_s=0.0).stop_after_s == 0.0
    served = DefaultMaxTokens(KeepsCriteria(n_ctx=600), stop=drain.criterion)
    criteria = served.create_completion("a b", max_tokens=5, stopping_criteria=[lambda ids, lg: False])
    assert len(criteria) == 2  # the request's own, and the drain's
    assert not criteria(None, None)  # no signal yet
    drain.start()
    assert not criteria(None, None)  # signalled: the grace runs first
    drain.started = time.monotonic() - 8.0
    assert criteria(None, None)  # past grace less margin: stopped at the next token
