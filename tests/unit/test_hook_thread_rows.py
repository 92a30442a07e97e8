"""tools/hook-thread-rows.py, accounting check: hook time over exact's less
deciding, store and copy waits. The waits are the decode calls' own where a record has
them (per_call_decode.stall_us): the whole run's, prompt included, read rows with large
experts 15-16 us under on DeepSeek-V2-Lite's shape."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from tests.unit.script_module import load_script as load_script_file


def load_script() -> ModuleType:
    return load_script_file("hook-thread-rows.py")


def record(
    hook: float,
    policy: float,
    store: float,
    stall_us: float | None,
    stall_ms_per_token: float,
    parts: tuple[float, float, float] | None = None,
) -> dict[str, Any]:
    per_call: dict[str, float] = {"hook_us": hook, "store_us": store, "exec_us": 0.0, "call_us": 0.0}
    if stall_us is not None:
        per_call["stall_us"] = stall_us
    if parts is not None:
        per_call.update(rule_us=parts[0], take_us=parts[1], post_us=parts[2])
    return {
        "policy_us_per_decode_call": policy,
        "stall_ms_per_token": stall_ms_per_token,
        "per_call_decode": per_call,
    }


def test_the_residual_takes_the_decode_calls_own_copy_waits() -> None:
    rows = load_script()
    exact = record(hook=100.0, policy=1.0, store=2.0, stall_us=0.0, stall_ms_per_token=0.0)
    # 30 us over exact's: 2 deciding, 8 store, 20 waiting for copies in the decode calls; the
    # whole run's waits (a prompt that fetched much) would read 300 us per call of 3 layers
    lru = record(hook=130.0, policy=3.0, store=10.0, stall_us=20.0, stall_ms_per_token=0.9)
    assert rows.residual(lru, exact, 3) == 0.0
    # a record from before stall_us: the whole run's waits, as before
    old = record(hook=130.0, policy=3.0, store=10.0, stall_us=None, stall_ms_per_token=0.06)
    assert abs(rows.residual(old, exact, 3) - 0.0) < 1e-9


def test_the_deciding_parts_are_medians_and_absent_from_old_records() -> None:
    rows = load_script()
    new = [
        record(1, 5, 0, 0, 0, parts=(2.0, 1.0, 1.5)),
        record(1, 5, 0, 0, 0, parts=(4.0, 3.0, 2.5)),
        record(1, 5, 0, 0, 0, parts=(3.0, 2.0, 2.0)),
    ]
    assert rows.deciding_parts(new) == "3.00 / 2.00 / 2.00"
    assert rows.deciding_parts([record(1, 5, 0, 0, 0)]) == "-"
