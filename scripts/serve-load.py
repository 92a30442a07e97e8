"""Load on `pyspice serve`: concurrent clients against 127.0.0.1 only, with
malformed requests, slow clients and disconnects mixed in; then a table of results
by class (status counts, errors), latency percentiles of the answered requests, and
the server's RSS at start and end. Starts its own server (`--serve-args` are passed
to it) unless --url names one (still 127.0.0.1 only). Not a test: numbers for the note.

    flock /tmp/pyspice-heavy.lock python scripts/serve-load.py -m smolmoe --clients 32 \\
        --seconds 600 --serve-args "-t 2 -c 2048"

Each client loops, picking a class by weight:
  complete     a completion of --max-tokens tokens
  stream       the same, streamed (SSE) to [DONE]
  malformed    a body that is not JSON, or invalid fields (expects 400/422)
  slow         a completion whose body arrives in pieces over ~2 s
  disconnect   a stream the client drops after its first event
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

CLASSES = {"complete": 5, "stream": 3, "malformed": 2, "slow": 1, "disconnect": 1}
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Mixture-of-Experts models"]
MALFORMED = [
    b"{not json",
    b'{"prompt": "hi", "max_tokens": "lots"}',
    b'{"prompt": "hi", "max_tokens": -5}',
    b"[1, 2, 3]",
]


@dataclass
class Results:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, cls: str, outcome: str, seconds: float | None = None) -> None:
        with self.lock:
            self.outcomes[cls][outcome] += 1
            if seconds is not None:
                self.latency[cls].append(seconds)


def body_for(max_tokens: int, stream: bool, rng: random.Random) -> bytes:
    doc = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0.7, "stream": stream}
    return json.dumps(doc).encode()


def headers(key: str | None, length: int) -> dict[str, str]:
    head = {"Content-Type": "application/json", "Content-Length": str(length)}
    if key:
        head["Authorization"] = f"Bearer {key}"
    return head


def one_request(
    cls: str, port: int, key: str | None, max_tokens: int, rng: random.Random, res: Results
) -> None:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        if cls == "slow":
            data = body_for(max_tokens, False, rng)
            conn.putrequest("POST", "/v1/completions")
            for k, v in headers(key, len(data)).items():
                conn.putheader(k, v)
            conn.endheaders()
            step = max(1, len(data) // 8)
            for i in range(0, len(data), step):
                conn.send(data[i : i + step])
                time.sleep(0.25)
        else:
            data = (
                rng.choice(MALFORMED) if cls == "malformed" else body_for(max_tokens, cls != "complete", rng)
            )
            conn.request("POST", "/v1/completions", data, headers(key, len(data)))
        resp = conn.getresponse()
        status = resp.status
        retry = float(resp.headers.get("retry-after") or 0) if status == 503 else 0.0
        if cls in ("stream", "disconnect") and status == 200:
            events, finished = 0, False
            while True:
                line = resp.fp.readline()
                if not line:
                    res.add(cls, "cut before [DONE]")
                    return 0.0
                if line.startswith(b"data:"):
                    events += 1
                    if cls == "disconnect":
                        conn.sock.shutdown(socket.SHUT_RDWR) if conn.sock else None
                        res.add(cls, "dropped after 1 event", time.monotonic() - start)
                        return 0.0
                    if line.strip() == b"data: [DONE]":
                        # an answer that ended as answers end has a finish_reason before [DONE]
                        outcome = "200 [DONE]" if finished else "200 [DONE], no finish_reason (cut)"
                        res.add(cls, outcome, time.monotonic() - start)
                        return 0.0
                    finished |= b'"finish_reason": "' in line
        resp.read()
        res.add(cls, str(status), time.monotonic() - start if status == 200 else None)
        return retry
    except (OSError, http.client.HTTPException) as exc:
        res.add(cls, f"error {type(exc).__name__}")
        return 0.0
    finally:
        conn.close()


def client(
    seed: int, deadline: float, port: int, key: str | None, max_tokens: int, backoff: bool, res: Results
) -> None:
    rng = random.Random(seed)
    names, weights = zip(*CLASSES.items(), strict=True)
    while time.monotonic() < deadline:
        retry = one_request(rng.choices(names, weights)[0], port, key, max_tokens, rng, res)
        if backoff and retry > 0:  # as a polite client does: Retry-After, with jitter
            time.sleep(min(retry * rng.uniform(0.5, 1.0), max(0.0, deadline - time.monotonic())))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_server(model: str, serve_args: str, key: str | None) -> tuple[subprocess.Popen[str], int]:
    argv = [sys.executable, "-m", "pyspice", "serve", "-m", model, "--host", "127.0.0.1", "--port", "0"]
    argv += shlex.split(serve_args) + (["--api-key", key] if key else [])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
        if found:
            # keep draining its log so it never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stderr or ()], daemon=True).start()
            return proc, int(found.group(1))
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "-m", "--model", default="smolmoe", help="model for the server it starts (default smolmoe)"
    )
    p.add_argument("--url", help="an already running server on 127.0.0.1 (http://127.0.0.1:PORT)")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    p.add_argument("--serve-args", default="-t 2", help="extra `pyspice serve` arguments (default '-t 2')")
    p.add_argument("--api-key", default=None, help="the server's key (also given to the server it starts)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    p.add_argument("--seconds", type=float, default=600.0, help="duration (default 600)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    p.add_argument(
        "--no-backoff", action="store_true", help="retry a 503 at once instead of after its Retry-After"
    )
    args = p.parse_args(argv)

    proc = None
    if args.url:
        found = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/?", args.url)
        if not found:
            p.error("--url must be http://127.0.0.1:PORT: load is never aimed at another machine")
        port, pid = int(found.group(1)), args.pid
    else:
        proc, port = start_server(args.model, args.serve_args, args.api_key)
        pid = proc.pid
    res = Results()
    rss_start = rss_mib(pid) if pid else float("nan")
    deadline = time.monotonic() + args.seconds
    threads = [
        threading.Thread(
            target=client, args=(i, deadline, port, args.api_key, args.max_tokens, not args.no_backoff, res)
        )
        for i in range(args.clients)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    rss_end = rss_mib(pid) if pid else float("nan")
    if proc is not None:
        proc.terminate()
        code = proc.wait(timeout=60)
        print(f"server: SIGTERM -> exit {code}")

    policy = "retry at once" if args.no_backoff else "Retry-After honoured"
    print(f"{args.clients} clients, {wall:.0f} s, max_tokens {args.max_tokens}, 503: {policy}")
    print(f"{'class':<11} {'requests':>8} {'p50 s':>7} {'p99 s':>7}  outcomes")
    total = Counter[str]()
    for cls in CLASSES:
        outcomes = res.outcomes.get(cls, Counter())
        lat = res.latency.get(cls, [])
        total.update(outcomes)
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
        print(f"{cls:<11} {sum(outcomes.values()):>8} {pct(lat, 0.5):>7.2f} {pct(lat, 0.99):>7.2f}  {shown}")
    answered = [x for cls in ("complete", "stream", "slow") for x in res.latency.get(cls, [])]
    mean = statistics.fmean(answered) if answered else float("nan")
    print(
        f"answered {len(answered)} ({len(answered) / wall:.2f}/s), p50 {pct(answered, 0.5):.2f} s, "
        f"p99 {pct(answered, 0.99):.2f} s, mean {mean:.2f} s"
    )
    other_5xx = sum(v for k, v in total.items() if k.startswith("5") and k != "503")
    errors = sum(v for k, v in total.items() if k.startswith("error") or k.startswith("cut"))
    print(f"503 busy: {total.get('503', 0)}; 5xx other: {other_5xx}; client errors and cut streams: {errors}")
    print(f"server RSS: {rss_start:.1f} MiB at start, {rss_end:.1f} MiB at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
