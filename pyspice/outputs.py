"""Writing outputs safely: never onto an input, always atomically.

Every file pyspice writes (sidecars, caches, profiles, trace parts) goes
through `atomic_output`: the bytes land in a hidden temporary sibling and are
renamed over the target only once complete, so a reader never sees half a
file and a failure (an exception, Ctrl-C) leaves nothing behind.
`check_output` is the rule every command applies to an output path before
it does any work, so a bad `-o` fails in milliseconds, not after a long run.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that must not be written (an input, a directory, no parent)."""


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # one of them does not exist
        return a.resolve() == b.resolve()


def check_output(out: Path, inputs: Sequence[Path], flag: str = "-o") -> Path:
    """`out` if a command may write it: not a directory, its folder exists, and it
    is none of `inputs` (by inode, so hard links and symlinks count too)."""
    if out.is_dir():
        raise OutputPathError(f"{flag} {out} is a directory: give a file name inside it")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputPathError(f"{flag} {out}: folder {parent} does not exist (create it first)")
    for source in inputs:
        if _same_file(out, source):
            raise OutputPathError(
                f"{flag} {out} is the input {source}: writing it would destroy it; pick another path"
            )
    return out


@contextlib.contextmanager
def atomic_output(out: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path beside `out` to write; renamed over `out` when the block
    succeeds, removed when it fails (BaseException too: Ctrl-C leaves nothing).

    suffix: how the temporary name ends (np.savez appends ".npz" to any other)."""
    out = Path(out)
    # a unique hidden sibling: same filesystem (so the rename is atomic), and two
    # writers of one target never share a temporary file; not created here, so
    # the writer's open() gives it the usual permissions (umask), as the target had
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
