"""How the fuzz smoke tests start a harness (tests/unit and tests/native/test_fuzz_smoke.py)."""

from __future__ import annotations


def through_forking_shell(argv: list[str]) -> list[str]:
    """`argv` run by a shell that forks rather than execs: a process exec'd straight from
    pytest inherits pytest's peak RSS (ru_maxrss survives exec), which inside the whole
    suite is past the -rss_limit_mb libFuzzer checks from its first input; a forked child
    starts its own count."""
    return ["sh", "-c", '"$@"; exit $?', "sh", *argv]
