"""The user surfaces end to end: `generate --json`, `inspect`, `chat`
through a pseudo-terminal, `serve` answered over loopback HTTP, and errors a
person can act on. Subprocesses on tiny synthetic models, a few tokens each."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pyspice.stats import STATS_KEYS

PYSPICE = [sys.executable, "-m", "pyspice"]
# a guard against a hung child, not a speed requirement
DEADLINE_S = 120.0


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([*PYSPICE, *args], capture_output=True, text=True, timeout=DEADLINE_S)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def tiny(synth_model: Any) -> Path:
    path: Path = synth_model("qwen2moe", "tiny", "Q8_0")
    return path


# ---- generate ------------------------------------------------------------------------------


def test_generate_json_is_text_tokens_and_the_stats_record(tiny: Path) -> None:
    common = ["generate", "-m", str(tiny), "-p", "Hello", "-n", "6", "--temp", "0", "-t", "2", "-c", "256"]
    exact = json.loads(run(*common, "--json").stdout)
    assert set(exact) >= {"text", "tokens", "stats"}
    assert len(exact["tokens"]) == 6 and all(isinstance(t, int) for t in exact["tokens"])
    assert isinstance(exact["text"], str) and exact["text"]
    assert set(STATS_KEYS) <= set(exact["stats"])
    assert exact["stats"]["policy"] == "exact" and exact["stats"]["hook_calls"] > 0
    stock = json.loads(run(*common, "--json", "--policy", "stock").stdout)
    assert stock["tokens"] == exact["tokens"] and stock["text"] == exact["text"]
    assert stock["stats"]["hook_calls"] == 0
    # streamed (no --json): the same text on standard output
    assert run(*common).stdout.rstrip("\n") == exact["text"]


def test_generate_on_an_emulated_device_is_labelled(tiny: Path) -> None:
    out = run(
        "generate", "-m", str(tiny), "-p", "Hi", "-n", "3", "--temp", "0", "-t", "2", "-c", "256",
        "--policy", "lru", "--device-budget", "25%", "--emulate-bandwidth", "4", "--json",
    )  # fmt: skip
    assert "emulated device" in out.stderr
    stats = json.loads(out.stdout)["stats"]
    assert stats["policy"] == "lru" and stats["misses"]["fetched"] > 0


# ---- inspect -------------------------------------------------------------------------------


def test_inspect_agrees_with_the_loaded_model(synth_model: Any) -> None:
    from pyspice.api import Llama

    for arch in ("qwen2moe", "deepseek2"):
        path = synth_model(arch, "tiny", "Q8_0")
        doc = json.loads(run("inspect", "-m", str(path), "--json", "--device-budget", "50%").stdout)
        llm = Llama(str(path), policy="exact", n_ctx=64, verbose=False)
        try:
            layers = llm.spice_layers()
        finally:
            llm.close()
        moe = [info for info in layers if info.is_moe]
        assert doc["architecture"] == arch and doc["n_layers"] == len(layers)
        assert doc["moe_layers"] == [info.il for info in moe]
        per_layer = {il: g["bytes"] for g in doc["bytes_per_expert"] for il in g["layers"]}
        assert per_layer == {info.il: info.bytes_per_expert for info in moe}
        assert doc["expert_bytes"] == sum(info.bytes_per_expert * info.n_expert for info in moe)
        assert doc["expert_bytes"] + doc["non_expert_bytes"] <= path.stat().st_size
        (fit,) = doc["budgets"]
        assert fit["budget_bytes"] == doc["expert_bytes"] // 2
        text = run("inspect", str(path)).stdout
        assert "--n-cpu-moe" in text and f"top-{doc['n_expert_used']}" in text


# ---- chat through a pseudo-terminal ----------------------------------------------------------


class Terminal:
    """A child process on a pseudo-terminal it owns (Ctrl-C there is SIGINT to it)."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()

        def own_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal, close_fds=True
        )
        os.close(slave)
        self.seen = ""

    def read_until(self, pattern: str, start: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            match = re.compile(pattern).search(self.seen, start)
            if match:
                return match
            left = deadline - time.monotonic()
            if left <= 0 or (self.proc.poll() is not None and not self._pending()):
                raise AssertionError(f"no {pattern!r} in the terminal; it shows:\n{self.seen[-3000:]}")
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    data = b""
                self.seen += data.decode("utf-8", errors="replace")

    def _pending(self) -> bool:
        return bool(select.select([self.master], [], [], 0)[0])

    def send(self, text: str) -> int:
        mark = len(self.seen)
        os.write(self.master, text.encode())
        return mark

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=DEADLINE_S)
        finally:
            os.close(self.master)


def test_chat_two_turns_stats_and_quit_in_a_terminal(tiny: Path) -> None:
    term = Terminal([*PYSPICE, "chat", "-m", str(tiny), "-n", "5", "--temp", "0", "-t", "2", "-c", "512"])
    try:
        term.read_until(r"commands: .*\n(.|\n)*> ")
        mark = term.send("Hello there\n")
        first = term.read_until(r"\[(\d+) tokens decoded[^\]]*\](.|\n)*> ", mark)
        mark = term.send("/stats\n")
        calls = int(term.read_until(r"hook_calls: (\d+)", mark).group(1))
        assert calls > 0
        term.read_until(r"policy: exact(.|\n)*> ", mark)
        mark = term.send("And a second question\n")
        second = term.read_until(r"\[(\d+) tokens decoded[^\]]*\](.|\n)*> ", mark)
        assert int(first.group(1)) > 0 and int(second.group(1)) > 0
        term.send("/quit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_ctrl_c_stops_the_answer_and_keeps_the_session(tiny: Path) -> None:
    # no -n: the answer would run until the context is full
    term = Terminal([*PYSPICE, "chat", "-m", str(tiny), "--temp", "0", "-t", "2", "-c", "8192"])
    try:
        term.read_until(r"commands: .*\n(.|\n)*> ")
        mark = term.send("Tell me everything\n")
        term.read_until(r"Tell me everything\r?\n.", mark)  # the answer has started streaming
        term.send("\x03")
        term.read_until(r"\[stopped: (.|\n)*> ", mark)
        mark = term.send("/stats\n")
        term.read_until(r"hook_calls: [1-9]", mark)
        term.send("/quit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


# ---- serve ---------------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=DEADLINE_S)


def _events(response: Any) -> Iterator[str]:
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_serve_answers_openai_clients_and_stops_cleanly(tiny: Path) -> None:
    server = subprocess.Popen(
        [*PYSPICE, "serve", "-m", str(tiny), "--port", "0", "-t", "2", "-c", "512", "--alias", "tiny"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        base = None
        for line in server.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                base = found.group(1)
                break
        assert base, "the server never said where it listens"

        models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=DEADLINE_S))
        assert [m["id"] for m in models["data"]] == ["tiny"]

        done = json.load(
            _post(f"{base}/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        )
        assert done["choices"][0]["text"] and done["usage"]["completion_tokens"] == 4

        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        reply = json.load(_post(f"{base}/v1/chat/completions", chat))
        whole = reply["choices"][0]["message"]["content"]
        events = list(_events(_post(f"{base}/v1/chat/completions", {**chat, "stream": True})))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert streamed == whole and len(chunks) > 2

        stats = json.load(urllib.request.urlopen(f"{base}/spice/stats", timeout=DEADLINE_S))
        assert stats["policy"] == "exact" and stats["hook_calls"] > 0 and "hit_rate" in stats

        # a second server on the same port: one line, before any model loads
        port = base.rsplit(":", 1)[1]
        taken = run("serve", "-m", str(tiny), "--port", port, check=False)
        assert taken.returncode == 1
        assert taken.stderr.strip().splitlines() == [
            f"pyspice: error: port {port} on 127.0.0.1 is in use (another server?): pick another with --port"
        ]
    finally:
        server.send_signal(signal.SIGINT)
        rest = server.communicate(timeout=DEADLINE_S)[1]
    assert server.returncode == 0, rest[-3000:]
    assert "server stopped" in rest


# ---- errors a person can act on ---------------------------------------------------------------


def _one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("pyspice: error:")]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def test_errors_are_one_line_with_a_way_out(tiny: Path, tmp_path: Path) -> None:
    gen = ["generate", "-p", "x", "-n", "1", "-t", "2"]
    missing = _one_line_error(run(*gen, "-m", str(tmp_path / "nope.gguf"), check=False))
    assert "does not exist" in missing

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny.read_bytes()[: 1 << 20])
    assert "truncated" in _one_line_error(run(*gen, "-m", str(truncated), check=False))

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello, I am not a model\n" * 10)
    assert "not a GGUF" in _one_line_error(run("inspect", "-m", str(not_gguf), check=False))

    huge = _one_line_error(run(*gen, "-m", str(tiny), "--device-budget", "100TB", check=False))
    assert "smaller --device-budget" in huge

    sidecar = _one_line_error(run(*gen, "-m", str(tiny), "--sidecar", str(tmp_path / "x.gguf"), check=False))
    assert "sidecar" in sidecar

    bad_policy = run(*gen, "-m", str(tiny), "--policy", "no-such-policy", check=False)
    assert bad_policy.returncode == 2 and "invalid choice: 'no-such-policy'" in bad_policy.stderr

    verbose = run(*gen, "-m", str(tmp_path / "nope.gguf"), "--verbose", check=False)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_a_dense_model_runs_with_stock_and_a_note(tmp_path: Path) -> None:
    from .dense_model import write_dense_llama

    dense = write_dense_llama(tmp_path / "dense.gguf")
    out = run("generate", "-m", str(dense), "-p", "Hello", "-n", "3", "--temp", "0", "-t", "2", "--json")
    assert "nothing to offload" in out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["tokens"]) == 3 and doc["stats"]["policy"] == "stock"
    assert "dense" in run("inspect", "-m", str(dense)).stdout


def test_the_dropin_example_runs(tiny: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "dropin.py"
    out = subprocess.run(
        [
            sys.executable,
            str(example),
            str(tiny),
            "-n",
            "4",
            "-t",
            "2",
            "--policy",
            "lru",
            "--device-budget",
            "50%",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "completion:" in out.stdout and "chat (streamed):" in out.stdout
    stats = json.loads(out.stdout[out.stdout.rindex("\n{\n") :])
    assert stats["policy"] == "lru" and stats["hook_calls"] > 0
    assert "emulated device" in out.stderr


def test_the_sidecar_beside_the_model_is_picked_up(tiny: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.symlink_to(tiny)
    (tmp_path / "m.spice.gguf").write_text("not a sidecar")
    # a policy that uses it: one line naming it and the fix
    argv = ["generate", "-m", str(model), "-p", "x", "-n", "1", "-t", "2"]
    out = run(*argv, "--policy", "spice", "--device-budget", "50%", check=False)
    message = _one_line_error(out)
    assert "bad sidecar" in message and "pyspice calibrate" in message and "--no-sidecar" in message
    # one that does not (exact, the CPU default): a warning, and the run goes on
    exact = run(*argv)
    assert "warning: ignoring" in exact.stderr and "m.spice.gguf" in exact.stderr
    # stock needs no sidecar and does not look for one
    stock = run("generate", "-m", str(model), "-p", "x", "-n", "1", "-t", "2", "--policy", "stock")
    assert "sidecar" not in stock.stderr
