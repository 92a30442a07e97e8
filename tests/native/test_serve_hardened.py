"""`pyspice serve` hardened, a real server on 127.0.0.1: the API key on every
route, 4xx JSON errors without server paths, the body limit, CORS off, an absent
max_tokens bounded, and SIGTERM letting an in-flight request finish, exit 0."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

PYSPICE = [sys.executable, "-m", "pyspice"]
DEADLINE_S = 120.0  # a guard against a hung child, not a speed requirement
KEY = "s3cret"


@pytest.fixture(scope="module")
def server(synth_model: Any) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    tiny = synth_model("qwen2moe", "tiny", "Q8_0")
    argv = [*PYSPICE, "serve", "-m", str(tiny), "--port", "0", "-t", "2", "-c", "512", "--api-key", KEY]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    base = None
    for line in proc.stderr:
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            base = found.group(1)
            break
    assert base, "the server never said where it listens"
    # keep reading its log so it never blocks on a full pipe
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    yield base, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def request(
    url: str, body: bytes | None = None, key: str | None = KEY, method: str | None = None, **headers: str
) -> tuple[int, dict[str, str], Any]:
    head = {"Content-Type": "application/json", **headers}
    if key is not None:
        head["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=head, method=method)
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


@pytest.mark.parametrize("path", ["/spice/stats", "/docs", "/openapi.json", "/v1/models"])
def test_every_route_needs_the_key(server: tuple[str, Any], path: str) -> None:
    base, _ = server
    assert request(base + path, key=None)[0] == 401
    assert request(base + path, key="wrong")[0] == 401
    status, _, _ = request(base + path) if path != "/docs" else (200, None, None)
    assert status == 200


@pytest.mark.parametrize(
    ("route", "body", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/chat/completions", b"not json at all", 400),
        ("/v1/chat/completions", b"{}", 422),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "lots"}', 422),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": -5}', 422),
        ("/v1/chat/completions", b'{"messages": [{"role": "alien", "content": "x"}]}', 422),
        ("/v1/completions", b'{"prompt": "' + b"x" * (1 << 20) + b'"}', 413),
    ],
)
def test_bad_requests_get_4xx_json_without_server_paths(
    server: tuple[str, Any], route: str, body: bytes, status: int
) -> None:
    base, _ = server
    got, head, doc = request(base + route, body)
    assert got == status, doc
    assert head["content-type"] == "application/json"
    text = json.dumps(doc)
    assert ".py" not in text and "site-packages" not in text and "Traceback" not in text


def test_cors_is_off_unless_asked(server: tuple[str, Any]) -> None:
    base, _ = server
    _, head, _ = request(base + "/v1/models", Origin="http://evil.example")
    assert not any(k.lower().startswith("access-control-") for k in head)


def test_a_chat_without_max_tokens_is_bounded(server: tuple[str, Any]) -> None:
    """Row 62: generated to the context limit; now min(context left, 512)."""
    base, _ = server
    chat = {"messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 0}
    status, _, doc = request(base + "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 200, doc
    usage = doc["usage"]
    assert usage["completion_tokens"] <= min(512 - usage["prompt_tokens"], 512)


def read_stream(base: str, body: dict[str, Any]) -> list[str]:
    """The `data:` payloads of a streamed completion, to the end of the response."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S)
    head = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), head)
    resp = conn.getresponse()
    assert resp.status == 200
    events = [line[5:].strip() for line in resp.read().decode().splitlines() if line.startswith("data:")]
    conn.close()
    return events


def test_a_queued_request_does_not_cut_a_stream_short(server: tuple[str, Any]) -> None:
    """Found by scripts/serve-load.py: 30 of 31 streams under 8 clients ended early, with
    [DONE] but no finish_reason -- llama-cpp-python's interrupt_requests stops a stream
    whenever another request waits. Now the waiting one waits its turn."""
    base, _ = server
    stream_body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}
    alone = read_stream(base, stream_body)
    assert alone[-1] == "[DONE]" and '"finish_reason": "length"' in alone[-2]
    other: dict[str, Any] = {}

    def queued() -> None:
        time.sleep(0.3)  # the stream is generating (300 tokens take over a second)
        body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
        other["answer"] = request(base + "/v1/completions", body)

    asker = threading.Thread(target=queued)
    asker.start()
    with_queue = read_stream(base, stream_body)
    asker.join(DEADLINE_S)
    assert other["answer"][0] == 200

    def texts(events: list[str]) -> list[str]:
        return [json.loads(e)["choices"][0]["text"] for e in events[:-1]]

    assert texts(with_queue) == texts(alone), "the stream was cut short while another request waited"


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(server: tuple[str, Any]) -> None:
    base, proc = server
    result: dict[str, Any] = {}

    def ask() -> None:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}).encode()
        result["answer"] = request(base + "/v1/completions", body)

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.5)  # the request is generating
    proc.send_signal(signal.SIGTERM)
    asker.join(DEADLINE_S)
    assert proc.wait(timeout=DEADLINE_S) == 0
    status, _, doc = result["answer"]
    assert status == 200 and doc["usage"]["completion_tokens"] > 0


def test_sigterm_ends_a_stream_in_flight_with_a_final_chunk_and_done_within_the_grace(
    synth_model: Any,
) -> None:
    """A stream that cannot finish within the grace (a slow emulated bus: about 20 s of
    tokens) keeps streaming after SIGTERM, then ends cleanly -- a final chunk with
    finish_reason "stop" and `data: [DONE]` -- before the grace is over, and the server
    exits 0. Before, sse-starlette cut it at the signal: no [DONE], "ASGI callable
    returned without completing response"."""
    grace = 4.0
    tiny = synth_model("qwen2moe", "tiny", "Q8_0")
    argv = [
        *PYSPICE, "serve", "-m", str(tiny), "--port", "0", "-t", "2", "-c", "512", "--grace", str(grace),
        "--policy", "lru", "--device-budget", "25%", "--emulate-bandwidth", "0.02",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:
            found = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
            if found:
                port = int(found.group(1))
                break
        assert port, "the server never said where it listens"
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events: list[str] = []
        sent = 0.0
        while True:
            line_b = resp.fp.readline()
            if not line_b:
                break
            text = line_b.decode().strip()
            if text.startswith("data:"):
                events.append(text[5:].strip())
                if len(events) == 1:  # generating: now the signal
                    proc.send_signal(signal.SIGTERM)
                    sent = time.monotonic()
        took = time.monotonic() - sent
        conn.close()
        assert proc.wait(timeout=DEADLINE_S) == 0, "".join(log)[-2000:]
        assert events[-1] == "[DONE]", (events[-3:], "".join(log)[-2000:])
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "stop"
        assert took < grace, f"the stream ended {took:.2f} s after SIGTERM, past the {grace:g} s grace"
        assert took > grace / 2, f"the stream was cut {took:.2f} s after SIGTERM, not let run"
        assert "ASGI callable returned without completing response" not in "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
