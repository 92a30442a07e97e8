"""atheris harness, differential: every GGUF our reader accepts loads in llama.cpp.

Each input is written to a file and opened with formats.model_info.read_header,
the check pyspice.Llama runs before llama.cpp sees a model. The reader's
documented error (ModelFileError) ends the input; any other exception is a
crash, as in fuzz_gguf_header.py. A file it accepts is then opened by
pyspice.Llama itself (llama.cpp's loader with pyspice's expert buffers, a
64-token context, the libspice runtime attached, policy "exact") and decodes
two tokens, in a child forked from this process, which imported and warmed
the libraries once. The child exits normally whether llama.cpp accepts the
file or refuses it with a ValueError or RuntimeError (llama-cpp-python's and
pyspice's load and decode errors). A crash is: the child dying by a signal
(SIGABRT from a GGML_ASSERT, SIGSEGV, SIGBUS...), the child running past
CHILD_TIMEOUT_S (5 s; PYSPICE_FUZZ_CHILD_TIMEOUT overrides it) or past 512 MiB
RSS, or an exception of another type in the child. The parent then raises
LlamaCrash with the child's last stderr lines; libFuzzer saves the input
(crash-<sha1> under -artifact_prefix). The child sends llama.cpp's warnings
and errors and a GGML_ASSERT's message (ggml's abort callback) to its log,
which llama-cpp-python would send to /dev/null. With PYSPICE_FUZZ_KEEP_GOING=DIR
each crash is saved under DIR with its message and the run goes on (to
explore; a run that counts leaves it unset or reports what DIR holds).

Inputs start from small complete models (fuzz/corpus/gguf_differential: a
qwen2moe and a deepseek2 in F32, a qwen2moe in Q8_0, made by `--seeds DIR`).
The custom mutator mostly edits the parsed header -- metadata values, types
and keys, tensor shapes, types, offsets and names -- and writes it back with
the tensor data unchanged, or grown to fit the new shapes, and (seven times in
ten) the offsets packed again in directory order, so that most inputs get past
the reader and reach llama.cpp; the rest are libFuzzer's own
byte mutations, of the header bytes or of the whole file. Three in ten start
again from a seed, since inputs the reader refuses pile up in the corpus. What
llama.cpp answered (loaded, or its reason for refusing) is coverage too (one
of 256 instrumented functions is called per answer), so an input that gets a
new answer from llama.cpp joins the corpus as new reader coverage does.

    python fuzz/fuzz_gguf_differential.py DIR fuzz/corpus/gguf_differential \\
        -runs=1000000 -timeout=30 -rss_limit_mb=1024 -max_len=1048576

(-timeout is the parent's limit per input, above the child's own; -max_len
and -timeout get those defaults when not given.) A line of counts goes to
stderr every 1000 inputs: inputs, accepted by the reader, loaded and
decoded, refused by llama.cpp, and the reasons llama.cpp gave most often.
Throughput is bounded by the fork and load: about 90-100 inputs/s on one core,
half of them loaded (docs/results/fuzzing.md).
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import math
import os
import random
import re
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import atheris
import gguf
import llama_cpp

ROOT = Path(__file__).resolve().parents[1]

with atheris.instrument_imports():
    from pyspice.formats.model_info import ModelFileError, read_header

# An uninstrumented copy of the header parser, for the mutator: what the mutator runs must
# not count as coverage of the target.
_spec = importlib.util.spec_from_file_location(
    "_fuzz_plain_gguf_header", ROOT / "pyspice/formats/gguf_header.py"
)
assert _spec is not None and _spec.loader is not None
_plain = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _plain  # dataclasses look their module up
_spec.loader.exec_module(_plain)

CHILD_TIMEOUT_S = float(os.environ.get("PYSPICE_FUZZ_CHILD_TIMEOUT", "5"))
CHILD_RSS_LIMIT_MB = 512
CHILD_ADDRESS_SPACE = 8 << 30  # a cap, so a runaway allocation fails in the child, not the machine
N_CTX = 64
MAX_GROWTH = 4 << 20  # the mutator grows the data section by at most this much
PRINT_EVERY = 1000
# exploring: record each crash (input and message, under this folder) and go on, rather than
# raise at the first; a run that counts has this unset
KEEP_GOING = os.environ.get("PYSPICE_FUZZ_KEEP_GOING", "")

_MAIN_PID = os.getpid()
_TMP = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def _remove_stale_work_dirs() -> None:
    """A run that crashed or was killed leaves its folder behind: remove those of dead runs."""
    for d in _TMP.glob("fuzz-differential-*-*"):
        pid = d.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


_remove_stale_work_dirs()
_WORK = Path(tempfile.mkdtemp(prefix=f"fuzz-differential-{_MAIN_PID}-", dir=_TMP))
MODEL = _WORK / "input.gguf"
CHILD_LOG = _WORK / "child.log"

VT = gguf.GGUFValueType


class LlamaCrash(Exception):
    """A file our reader accepted killed or hung llama.cpp (or pyspice's load of it)."""


# ---- the target ------------------------------------------------------------------------------


@dataclass
class Stats:
    inputs: int = 0
    accepted: int = 0  # by our reader, and so loaded in a child
    loaded: int = 0  # loaded and decoded
    refused_load: int = 0
    refused_decode: int = 0
    max_child_rss_mb: float = 0.0
    crashes: collections.Counter[str] = field(default_factory=collections.Counter)  # with KEEP_GOING
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    started: float = field(default_factory=time.monotonic)
    printed: float = 0.0

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        top = "; ".join(f"{n}x {r}" for r, n in self.reasons.most_common(4))
        return (
            f"differential: {self.inputs} inputs ({self.inputs / max(elapsed, 1e-9):.1f}/s), "
            f"{self.accepted} accepted by the reader, {self.loaded} loaded and decoded, "
            f"{self.refused_load} refused at load and {self.refused_decode} at decode by llama.cpp, "
            f"child RSS max {self.max_child_rss_mb:.0f} MiB; top reasons: {top}"
            + (
                f"; {sum(self.crashes.values())} crashes kept in {KEEP_GOING}, {len(self.crashes)} kinds"
                if KEEP_GOING
                else ""
            )
        )


STATS = Stats()
_DIGITS = re.compile(r"\d+")


def _load_and_decode(path: Path) -> int:
    """In the child: 0 loaded and decoded, 1 refused at load, 2 refused at decode."""
    from pyspice.api import Llama

    try:
        llm = Llama(
            str(path), n_ctx=N_CTX, n_batch=8, n_ubatch=8, n_threads=1, n_threads_batch=1, verbose=False
        )
    except (ValueError, RuntimeError) as exc:
        print(f"pyspice-fuzz refused at load: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    try:
        llm.eval([0, max(0, llm.n_vocab() - 1)])
    except (ValueError, RuntimeError) as exc:
        print(f"pyspice-fuzz refused at decode: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        llm.close()
    return 0


_log_fd = -1  # the child's log, where llama.cpp's warnings and errors go
_log_level = 0


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _log_to_child_log(level: int, text: bytes, _user: Any) -> None:
    """llama.cpp's warnings and errors (ggml_log_level WARN 3, ERROR 4, and CONT 5 after them)
    to the log: with verbose=False llama-cpp-python sends fds 1 and 2 to /dev/null while it loads."""
    global _log_level
    _log_level = _log_level if level == 5 else level
    if _log_level in (3, 4) and _log_fd >= 0:
        os.write(_log_fd, text)


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)  # type: ignore[untyped-decorator]
def _abort_to_child_log(message: bytes) -> None:
    """A GGML_ASSERT's message, which ggml would print to the hidden stderr, to the log
    (ggml calls abort() when this returns)."""
    if _log_fd >= 0:
        os.write(_log_fd, b"GGML abort: " + message + b"\n")


_GGML_BASE = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
_GGML_BASE.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
_GGML_BASE.ggml_set_abort_callback.restype = ctypes.c_void_p


def _child(path: Path) -> NoReturn:
    global _log_fd
    code = 3
    try:
        # libFuzzer's handlers would turn a signal into its own exit: restore the defaults
        for sig in (
            signal.SIGSEGV,
            signal.SIGBUS,
            signal.SIGABRT,
            signal.SIGFPE,
            signal.SIGILL,
            signal.SIGTRAP,
        ):
            signal.signal(sig, signal.SIG_DFL)
        _log_fd = os.open(CHILD_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        os.dup2(_log_fd, 1)
        os.dup2(_log_fd, 2)
        llama_cpp.llama_log_set(_log_to_child_log, ctypes.c_void_p(0))
        _GGML_BASE.ggml_set_abort_callback(ctypes.cast(_abort_to_child_log, ctypes.c_void_p))
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))
        code = _load_and_decode(path)
    except BaseException:
        traceback.print_exc()
        code = 3
    finally:
        os._exit(code)


def _child_log(limit: int = 2500) -> str:
    try:
        text = CHILD_LOG.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-limit:]


def _refusal_reason() -> str:
    """llama.cpp's reason (else pyspice's), digits dropped, so like refusals count together."""
    text = _child_log(4000)
    for marker in (
        "gguf_init_from_reader: ",
        "error loading model: ",
        "llama_init_from_model: ",
        "pyspice-fuzz refused at ",
    ):
        at = text.find(marker)
        if at >= 0:
            return _DIGITS.sub("N", text[at + len(marker) :].splitlines()[0])[:120]
    return "(no reason given)"


def _make_outcomes(n: int) -> list[Any]:
    """n instrumented functions, each its own code: calling one is coverage libFuzzer sees, so
    an input that gets a new answer from llama.cpp joins the corpus, as new reader coverage does."""
    made = []
    for i in range(n):
        scope: dict[str, Any] = {}
        exec(compile(f"def outcome_{i}():\n    return {i}\n", f"<llama.cpp outcome {i}>", "exec"), scope)
        made.append(atheris.instrument_func(scope[f"outcome_{i}"]))
    return made


_OUTCOMES = _make_outcomes(256)


def _note_outcome(code: int, reason: str) -> None:
    _OUTCOMES[zlib.crc32(f"{code}:{reason}".encode()) % len(_OUTCOMES)]()


def load_in_child(path: Path) -> int:
    """Fork, load and decode `path` in the child; raise LlamaCrash on a signal, hang or
    undocumented error. Returns the child's exit code (0, 1 or 2)."""
    pid = os.fork()
    if pid == 0:
        _child(path)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], CHILD_TIMEOUT_S)
    finally:
        os.close(pidfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.wait4(pid, 0)
        raise LlamaCrash(
            f"loading a file the reader accepted ran past {CHILD_TIMEOUT_S:g} s; "
            f"its stderr ends:\n{_child_log()}"
        )
    _, status, usage = os.wait4(pid, 0)
    rss_mb = usage.ru_maxrss / 1024
    STATS.max_child_rss_mb = max(STATS.max_child_rss_mb, rss_mb)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise LlamaCrash(
            f"llama.cpp died by {name} on a file the reader accepted; its stderr ends:\n{_child_log()}"
        )
    code = os.WEXITSTATUS(status)
    if code not in (0, 1, 2):
        raise LlamaCrash(
            f"loading a file the reader accepted raised an undocumented error (exit {code}):\n{_child_log()}"
        )
    if rss_mb > CHILD_RSS_LIMIT_MB:
        raise LlamaCrash(
            f"loading a file the reader accepted took {rss_mb:.0f} MiB RSS (> {CHILD_RSS_LIMIT_MB})"
        )
    return code


def _keep(data: bytes, message: str) -> None:
    import hashlib

    lines = message.splitlines()
    kind = _DIGITS.sub("N", next((ln for ln in lines if ln.startswith("GGML abort: ")), lines[0]))[:160]
    STATS.crashes[kind] += 1
    if STATS.crashes[kind] <= 5:
        folder = Path(KEEP_GOING)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"crash-{hashlib.sha1(data).hexdigest()}"
        (folder / f"{name}.gguf").write_bytes(data)
        (folder / f"{name}.txt").write_text(message + "\n")


def one_input(data: bytes) -> None:
    STATS.inputs += 1
    now = time.monotonic()
    if STATS.inputs % PRINT_EVERY == 0 or now - STATS.printed > 60:
        STATS.printed = now
        print(STATS.line(), file=sys.stderr, flush=True)
    MODEL.write_bytes(data)
    try:
        read_header(MODEL)
    except ModelFileError:
        return  # the documented error: llama.cpp never sees the file
    STATS.accepted += 1
    try:
        code = load_in_child(MODEL)
    except LlamaCrash as exc:
        if not KEEP_GOING:
            raise
        _keep(data, str(exc))
        return
    if code == 0:
        STATS.loaded += 1
        _note_outcome(0, "")
        return
    if code == 1:
        STATS.refused_load += 1
    else:
        STATS.refused_decode += 1
    reason = _refusal_reason()
    STATS.reasons[reason] += 1
    _note_outcome(code, reason)


def warm_up(model: Path) -> None:
    """Load and decode once here, with output hidden, so each child starts with the
    libraries loaded, the backends registered and the lazy imports done."""
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        code = _load_and_decode(model)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
    if code != 0:
        raise SystemExit(f"fuzz_gguf_differential: the warm-up model {model} does not load")


# ---- the mutator: the header parsed, edited, written back --------------------------------------

_SCALAR_FORMATS = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<?",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}
_INT_TYPES = (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)
_FLOAT_TYPES = (VT.FLOAT32, VT.FLOAT64)
_INTS = (
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    16,
    31,
    32,
    33,
    63,
    64,
    65,
    127,
    128,
    255,
    256,
    257,
    383,
    384,
    385,
    511,
    512,
    513,
    1024,
    4096,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**64 - 1,
    -1,
    -2,
)
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-6, 1e-30, 1e30, 3.4e38, math.inf, -math.inf, math.nan, 10000.0)
_STRINGS = (
    b"",
    b"qwen2moe",
    b"deepseek2",
    b"llama",
    b"qwen3moe",
    b"mixtral",
    b"gpt2",
    b"bert",
    b"t5",
    b"none",
    b"no_vocab",
    b"rwkv",
    b"plamo2",
    b"default",
    b"linear",
    b"yarn",
    b"longrope",
    b"bogus",
    b"\xff\xfe",
    b"x" * 300,
)
# metadata a qwen2moe or deepseek2 load reads (llama.cpp's src/llama-arch.cpp, llama-model.cpp, models/)
_ARCH_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "expert_count",
    "expert_used_count",
    "expert_group_count",
    "expert_group_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "expert_shared_count",
    "expert_weights_scale",
    "expert_weights_norm",
    "expert_gating_func",
    "leading_dense_block_count",
    "nextn_predict_layers",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.key_length_mla",
    "attention.value_length_mla",
    "attention.q_lora_rank",
    "attention.kv_lora_rank",
    "attention.layer_norm_rms_epsilon",
    "attention.layer_norm_epsilon",
    "attention.sliding_window",
    "attention.causal",
    "attention.temperature_scale",
    "attention.temperature_length",
    "attention.key_length_swa",
    "attention.value_length_swa",
    "rope.dimension_count",
    "rope.dimension_count_swa",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.attn_factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_log_multiplier",
    "rope.scaling.finetuned",
    "rope.scale_linear",
    "pooling_type",
    "embedding_length_out",
    "classifier.output_labels",
    "logit_scale",
)
_GLOBAL_KEYS = (
    "general.architecture",
    "general.alignment",
    "general.file_type",
    "general.name",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)
_TENSOR_TYPES = (*(int(t) for t in gguf.GGMLQuantizationType), 4, 5, 40, 1000, 2**31)


class _Unsupported(Exception):
    """A header the mutator does not rebuild (nested arrays): byte mutation instead."""


@dataclass
class _Kv:
    key: str
    vtype: int
    value: Any
    sub: int | None = None


@dataclass
class _Tensor:
    name: str
    shape: list[int]
    type_id: int
    offset: int


@dataclass
class _Gguf:
    version: int
    kvs: list[_Kv]
    tensors: list[_Tensor]
    data: bytes  # the data section, from the first aligned offset after the header

    @classmethod
    def parse(cls, buf: bytes) -> _Gguf:
        header = _plain.parse_header(buf, Path("m"), raw_strings=True)
        kvs = []
        for kv in header.metadata:
            if kv.sub_type == VT.ARRAY:
                raise _Unsupported
            kvs.append(
                _Kv(kv.key, int(kv.vtype), kv.value, None if kv.sub_type is None else int(kv.sub_type))
            )
        tensors = [_Tensor(t.name, list(t.shape), t.type_id, t.offset) for t in header.tensors]
        g = cls(header.version, kvs, tensors, b"")
        start = _align_up(header.end, g.alignment())
        g.data = bytes(buf[start:])
        return g

    def alignment(self) -> int:
        for kv in self.kvs:
            a = kv.value
            if (
                kv.key == "general.alignment"
                and kv.vtype in _INT_TYPES
                and 0 < a <= 1 << 16
                and a & (a - 1) == 0
            ):
                return int(a)
        return 32

    def arch(self) -> str:
        for kv in self.kvs:
            if kv.key == "general.architecture" and isinstance(kv.value, bytes):
                return kv.value.decode("utf-8", "replace")
        return "qwen2moe"

    def to_bytes(self) -> bytes:
        out = [b"GGUF", struct.pack("<IQQ", self.version & 0xFFFFFFFF, len(self.tensors), len(self.kvs))]
        for kv in self.kvs:
            out += [_string(kv.key.encode()), struct.pack("<I", kv.vtype), _value(kv.vtype, kv.value, kv.sub)]
        for t in self.tensors:
            out += [_string(t.name.encode()), struct.pack("<I", len(t.shape))]
            out += [struct.pack("<Q", d & (2**64 - 1)) for d in t.shape]
            out.append(struct.pack("<IQ", t.type_id & 0xFFFFFFFF, t.offset & (2**64 - 1)))
        header = b"".join(out)
        return header + bytes(_align_up(len(header), self.alignment()) - len(header)) + self.data

    def pack_offsets(self) -> bool:
        """Offsets in directory order, each tensor where the one before ends (padded to the
        alignment), as gguf.cpp reads them; False (nothing changed) where a shape or type
        has no size."""
        offsets, end = [], 0
        for t in self.tensors:
            nbytes = _tensor_bytes(t)
            if nbytes is None:
                return False
            offsets.append(end)
            end = _align_up(end + nbytes, self.alignment())
        for t, offset in zip(self.tensors, offsets, strict=True):
            t.offset = offset
        return True

    def data_needed(self) -> int:
        """The data section's size for every tensor to fit (-1: a shape or type no size fits)."""
        end = 0
        for t in self.tensors:
            nbytes = _tensor_bytes(t)
            if nbytes is None:
                return -1
            end = max(end, t.offset + nbytes)
        return end


def _tensor_bytes(t: _Tensor) -> int | None:
    """A tensor's data bytes (the uninstrumented reader's tensor_nbytes); None where its
    type is unknown or its rows are not whole blocks."""
    try:
        qtype = gguf.GGMLQuantizationType(t.type_id)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
    except (ValueError, KeyError):
        return None
    if not t.shape or t.shape[0] % block:
        return None
    nbytes: int = _plain.tensor_nbytes(qtype.name, tuple(t.shape))
    return nbytes


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any, sub: int | None) -> bytes:
    if vtype == VT.STRING:
        return _string(value if isinstance(value, bytes) else str(value).encode())
    if vtype == VT.ARRAY:
        assert sub is not None
        return struct.pack("<IQ", sub, len(value)) + b"".join(_value(sub, v, None) for v in value)
    return struct.pack(_SCALAR_FORMATS[VT(vtype)], _fit(vtype, value))


def _fit(vtype: int, value: Any) -> Any:
    """`value` as the scalar type `vtype` can hold (integers wrap, as a C cast does)."""
    if vtype in _FLOAT_TYPES:
        return float(value) if isinstance(value, int | float) else 0.0
    if vtype == VT.BOOL:
        return bool(value)
    fmt = _SCALAR_FORMATS[VT(vtype)]
    bits = struct.calcsize(fmt) * 8
    v = int(value) if isinstance(value, int | float) and math.isfinite(value) else 0
    v &= (1 << bits) - 1
    if fmt[1].islower() and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def _some_int(rng: random.Random, current: Any = None) -> int:
    if isinstance(current, int) and rng.random() < 0.4:
        return rng.choice(
            (current - 1, current + 1, current * 2, current // 2, current + rng.randrange(-8, 9))
        )
    return rng.choice(_INTS) if rng.random() < 0.8 else rng.getrandbits(rng.choice((8, 16, 32, 64)))


def _some_value(rng: random.Random, vtype: int, current: Any = None) -> Any:
    if vtype in _INT_TYPES:
        return _some_int(rng, current)
    if vtype in _FLOAT_TYPES:
        return rng.choice(_FLOATS) if rng.random() < 0.8 else rng.uniform(-1e6, 1e6)
    if vtype == VT.BOOL:
        return not current if isinstance(current, bool) else rng.random() < 0.5
    if vtype == VT.STRING:
        if isinstance(current, bytes) and current and rng.random() < 0.3:
            i = rng.randrange(len(current))
            return current[:i] + bytes([rng.randrange(256)]) + current[i + 1 :]
        return rng.choice(_STRINGS)
    return 0


def _mutate_array(rng: random.Random, kv: _Kv, g: _Gguf) -> None:
    items: list[Any] = list(kv.value)
    roll = rng.random()
    if roll < 0.2:
        del items[rng.randrange(len(items) + 1) :]
    elif roll < 0.35 and items:
        items += [items[-1]] * rng.choice((1, 2, 8))
    elif roll < 0.45:
        items = [] if rng.random() < 0.5 else items[:1]
    elif roll < 0.55:
        kv.sub = rng.choice((*_INT_TYPES, *_FLOAT_TYPES, VT.STRING, VT.BOOL))
        items = [_some_value(rng, kv.sub) for _ in items[: rng.choice((1, 4, len(items) or 1))]]
    elif items:
        assert kv.sub is not None
        for _ in range(rng.choice((1, 1, 2, 5))):
            i = rng.randrange(len(items))
            items[i] = _some_value(rng, kv.sub, items[i])
    kv.value = items


def _retype(rng: random.Random, kv: _Kv, g: _Gguf) -> None:
    """A scalar as another type, or as a per-layer array (as some architectures write)."""
    scalar = kv.value if kv.vtype != VT.ARRAY else 0
    roll = rng.random()
    if roll < 0.4 and kv.vtype in (*_INT_TYPES, *_FLOAT_TYPES):
        n_layer = next(
            (k.value for k in g.kvs if k.key.endswith(".block_count") and isinstance(k.value, int)), 2
        )
        n = max(0, min(64, n_layer + rng.choice((0, 0, 0, -1, 1))))
        kv.sub, kv.vtype = kv.vtype, VT.ARRAY
        kv.value = [scalar if rng.random() < 0.7 else _some_value(rng, kv.sub, scalar) for _ in range(n)]
    else:
        kv.vtype = rng.choice((*_INT_TYPES, *_FLOAT_TYPES, VT.BOOL, VT.STRING))
        kv.sub = None
        kv.value = _fit(kv.vtype, scalar) if kv.vtype not in (VT.STRING,) else str(scalar).encode()
        if kv.vtype in _INT_TYPES and not isinstance(scalar, int | float):
            kv.value = _some_int(rng)


def _mutate_kv(rng: random.Random, g: _Gguf) -> None:
    if not g.kvs:
        return
    kv = rng.choice(g.kvs)
    roll = rng.random()
    if roll < 0.1:
        _retype(rng, kv, g)
    elif kv.vtype == VT.ARRAY:
        _mutate_array(rng, kv, g)
    else:
        kv.value = _some_value(rng, kv.vtype, kv.value)


def _add_kv(rng: random.Random, g: _Gguf) -> None:
    arch = g.arch()
    key = f"{arch}.{rng.choice(_ARCH_KEYS)}" if rng.random() < 0.75 else rng.choice(_GLOBAL_KEYS)
    vtype = rng.choice((VT.UINT32, VT.UINT32, VT.INT32, VT.UINT64, VT.FLOAT32, VT.BOOL, VT.STRING))
    kv = _Kv(key, vtype, _some_value(rng, vtype))
    if rng.random() < 0.15:
        _retype(rng, kv, g)
    g.kvs.insert(rng.randrange(len(g.kvs) + 1), kv)


def _edit_kv_list(rng: random.Random, g: _Gguf) -> None:
    if not g.kvs:
        return
    i = rng.randrange(len(g.kvs))
    roll = rng.random()
    if roll < 0.4:
        del g.kvs[i]
    elif roll < 0.6:
        g.kvs.insert(rng.randrange(len(g.kvs) + 1), replace(g.kvs[i]))  # the same key twice
    elif roll < 0.8:
        g.kvs[i].key = (
            f"{rng.choice(('qwen2moe', 'deepseek2', 'llama'))}.{g.kvs[i].key.split('.', 1)[-1]}"
            if rng.random() < 0.5
            else f"{g.arch()}.{rng.choice(_ARCH_KEYS)}"
        )
    else:
        j = rng.randrange(len(g.kvs))
        g.kvs[i], g.kvs[j] = g.kvs[j], g.kvs[i]


def _mutate_tensor(rng: random.Random, g: _Gguf) -> None:
    if not g.tensors:
        return
    t = rng.choice(g.tensors)
    roll = rng.random()
    if roll < 0.35 and t.shape:
        d = rng.randrange(len(t.shape))
        other = rng.choice(g.tensors).shape
        t.shape[d] = rng.choice(other) if other and rng.random() < 0.3 else _some_int(rng, t.shape[d]) % 2**64
    elif roll < 0.45:
        if len(t.shape) > 1 and rng.random() < 0.5:
            del t.shape[rng.randrange(len(t.shape))]
        else:
            t.shape.insert(rng.randrange(len(t.shape) + 1), rng.choice((1, 1, 2, 4)))
    elif roll < 0.6:
        t.type_id = rng.choice(_TENSOR_TYPES)
    elif roll < 0.7:
        step = g.alignment()
        t.offset = max(
            0,
            rng.choice(
                (
                    0,
                    t.offset - step,
                    t.offset + step,
                    rng.choice(g.tensors).offset,
                    t.offset + 1,
                    len(g.data),
                    2**63,
                )
            ),
        )
    elif roll < 0.85:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m and rng.random() < 0.5:
            t.name = f"blk.{_some_int(rng, int(m.group(1))) % 1000}.{m.group(2)}"
        else:
            t.name = rng.choice(g.tensors).name if rng.random() < 0.5 else t.name.replace("_exps", "_shexp")
    else:
        u = rng.choice(g.tensors)
        t.shape, u.shape = u.shape, t.shape
        t.type_id, u.type_id = u.type_id, t.type_id


def _edit_tensor_list(rng: random.Random, g: _Gguf) -> None:
    if not g.tensors:
        return
    i = rng.randrange(len(g.tensors))
    if rng.random() < 0.6:
        del g.tensors[i]
    else:
        t = g.tensors[i]
        g.tensors.insert(
            rng.randrange(len(g.tensors) + 1), _Tensor(t.name, list(t.shape), t.type_id, t.offset)
        )


def _edit_file(rng: random.Random, g: _Gguf) -> None:
    roll = rng.random()
    if roll < 0.3:
        g.version = rng.choice((1, 2, 3, 4, 2**31))
    elif roll < 0.6:
        g.kvs = [kv for kv in g.kvs if kv.key != "general.alignment"]
        g.kvs.append(
            _Kv("general.alignment", VT.UINT32, rng.choice((0, 1, 2, 3, 8, 16, 64, 256, 4096, 2**31)))
        )
    elif g.data:
        cut = rng.randrange(len(g.data))
        g.data = g.data[:cut]


_EDITS = (
    (_mutate_kv, 40),
    (_add_kv, 10),
    (_edit_kv_list, 10),
    (_mutate_tensor, 30),
    (_edit_tensor_list, 5),
    (_edit_file, 5),
)


def mutate_structured(buf: bytes, max_size: int, rng: random.Random) -> bytes:
    g = _Gguf.parse(buf)
    funcs, weights = zip(*_EDITS, strict=True)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        rng.choices(funcs, weights)[0](rng, g)
    if rng.random() < 0.7:
        # packed as gguf.cpp wants, most of the time, so that a new shape or type reaches
        # llama.cpp's model loader; the rest keep what the edits made of the offsets
        g.pack_offsets()
    need = g.data_needed()
    if need >= 0 and len(g.data) < need <= len(g.data) + MAX_GROWTH and rng.random() < 0.8:
        g.data += bytes(need - len(g.data))  # room for the new shapes: the reader would refuse it otherwise
    out = g.to_bytes()
    return out[:max_size]


def mutate_header_bytes(buf: bytes, max_size: int) -> bytes:
    """libFuzzer's mutations of the header only; the data section follows, re-aligned."""
    try:
        g = _Gguf.parse(buf)
        header_len = len(buf) - len(g.data)
    except (ValueError, OverflowError, _Unsupported):
        header_len, g = min(len(buf), 16384), None
    head: bytes = atheris.Mutate(buf[:header_len], max(1, header_len + 256))
    rest = buf[header_len:]
    if g is not None:
        head += bytes(_align_up(len(head), g.alignment()) - len(head))
    return (head + rest)[:max_size]


_BASES: list[bytes] = []  # the seed models, as write_seeds makes them


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if _BASES and rng.random() < 0.3:
        data = rng.choice(_BASES)  # a fresh start: inputs the reader refuses pile up in the corpus
    roll = rng.random()
    if roll < 0.75:
        try:
            return mutate_structured(data, max_size, rng)
        except (ValueError, OverflowError, struct.error, _Unsupported):
            pass  # not a header the mutator can rebuild
    if roll < 0.95:
        return mutate_header_bytes(data, max_size)
    mutated: bytes = atheris.Mutate(data, max_size)
    return mutated


# ---- seeds ------------------------------------------------------------------------------------


def write_seeds(corpus: Path) -> list[Path]:
    """The seed corpus: complete tiny models llama.cpp loads, as small as they can be."""
    from gguf import GGUFWriter

    from pyspice.models import synth

    corpus.mkdir(parents=True, exist_ok=True)
    vocab = _WORK / "vocab.gguf"
    # SentencePiece-shaped: <unk> <s> </s>, byte tokens 0x00-0x0F (llama.cpp looks up "\n"), a few words
    words = [f"\u2581{w}".encode() for w in ("the", "a", "of", "is", "to", "in", "and")]
    tokens = [b"<unk>", b"<s>", b"</s>", *(f"<0x{i:02X}>".encode() for i in range(16)), *words]
    w = GGUFWriter(vocab, "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_key_value("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING)
    w.add_key_value("tokenizer.ggml.scores", [-float(i) for i in range(len(tokens))], VT.ARRAY, VT.FLOAT32)
    types = [2, 3, 3, *[6] * 16, *[1] * len(words)]  # unknown, control, byte, normal
    w.add_key_value("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    shape = replace(
        synth.SHAPES["tiny"],
        name="fuzz-seed",
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_head_kv=1,
        n_ctx=N_CTX,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=16,
        n_ff=32,
        n_ff_shexp=16,
        n_dense_lead=1,
        n_expert_shared=1,
        kv_lora_rank=16,
        qk_nope_dim=8,
        qk_rope_dim=8,
        v_head_dim=8,
    )
    synth.SHAPES.setdefault(shape.name, shape)
    made = [
        synth.synthesize("qwen2moe", shape.name, corpus / "qwen2moe-f32.gguf", vocab=vocab),
        synth.synthesize("deepseek2", shape.name, corpus / "deepseek2-f32.gguf", vocab=vocab),
        synth.synthesize("qwen2moe", shape.name, corpus / "qwen2moe-q8_0.gguf", vocab=vocab, quant="Q8_0"),
    ]
    vocab.unlink()
    return made


def _with_defaults(argv: list[str]) -> list[str]:
    given = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    defaults = {"-max_len": "1048576", "-timeout": str(int(CHILD_TIMEOUT_S * 2 + 20))}
    return [*argv, *(f"{k}={v}" for k, v in defaults.items() if k not in given)]


def _clean_up(_arg: Any = None) -> None:
    if os.getpid() != _MAIN_PID:
        return
    if STATS.inputs:
        print(STATS.line(), file=sys.stderr, flush=True)
    for p in sorted(_WORK.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    _WORK.rmdir()


# libFuzzer ends the process with exit(), which skips Python's atexit: register with the C library
_AT_EXIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_clean_up)


def main() -> None:
    if sys.argv[1:2] == ["--seeds"]:
        try:
            for path in write_seeds(Path(sys.argv[2])):
                print(f"{path} {path.stat().st_size} bytes")
        finally:
            _clean_up()
        return
    ctypes.CDLL("libc.so.6").__cxa_atexit(_AT_EXIT, None, None)
    seeds = write_seeds(_WORK / "warm")
    _BASES.extend(p.read_bytes() for p in seeds)
    warm_up(seeds[0])
    atheris.Setup(_with_defaults(sys.argv), one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
