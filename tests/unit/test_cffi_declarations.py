"""pyspice.runtime derives its cffi declarations from spice.h; they must parse and agree with policy."""

from __future__ import annotations

from pathlib import Path

import cffi

from pyspice.policy import (
    ACTION_DEVICE,
    ACTION_DROP,
    ACTION_HOST,
    ACTION_SURROGATE,
    RESIDENCY_ABSENT,
    RESIDENCY_COPYING,
    RESIDENCY_QUEUED,
    RESIDENCY_RESIDENT,
)
from pyspice.runtime import cdef_from_header
from pyspice.sim import tier

HEADER = Path(__file__).resolve().parents[2] / "native" / "include" / "spice.h"


def test_header_parses_and_action_values_match_the_policy_package() -> None:
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(HEADER.read_text()))
    lib = ffi.dlopen(None)  # only the constants are read; no symbol is called
    assert (
        lib.SPICE_ACTION_DEVICE,
        lib.SPICE_ACTION_HOST,
        lib.SPICE_ACTION_SURROGATE,
        lib.SPICE_ACTION_DROP,
    ) == (ACTION_DEVICE, ACTION_HOST, ACTION_SURROGATE, ACTION_DROP)
    from pyspice import runtime
    from pyspice.runtime import hook

    assert (lib.SPICE_POLICY_OK, lib.SPICE_POLICY_FAILED, lib.SPICE_POLICY_ABORT) == (
        hook._POLICY_OK,
        hook._POLICY_FAILED,
        hook._POLICY_ABORT,
    )
    assert ffi.sizeof("spice_counters") == len(_counter_fields()) * 8
    assert (lib.SPICE_RES_ABSENT, lib.SPICE_RES_QUEUED, lib.SPICE_RES_COPYING, lib.SPICE_RES_RESIDENT) == (
        RESIDENCY_ABSENT,
        RESIDENCY_QUEUED,
        RESIDENCY_COPYING,
        RESIDENCY_RESIDENT,
    )
    # the simulator's tier returns libspice's status codes and priorities
    assert (lib.SPICE_OK, lib.SPICE_ERR_BUDGET, lib.SPICE_ERR_STATE) == (
        tier.OK,
        tier.REFUSED_BUDGET,
        tier.REFUSED_STATE,
    )
    assert (lib.SPICE_PRIORITY_PREFETCH, lib.SPICE_PRIORITY_DEMAND) == (
        tier.PRIORITY_PREFETCH,
        tier.PRIORITY_DEMAND,
    )
    # slot precisions: runtime's numbers are spice.h's, and the names a policy may ask
    # for (policy.base, which imports no native code; SpiceConfig's type) are runtime's
    from typing import get_args

    from pyspice.policy.base import SLOT_PRECISIONS
    from pyspice.policy.spice.config import SlotPrecision

    assert runtime.SLOT_PRECISIONS == {
        "exact": lib.SPICE_SLOT_EXACT,
        "4bit": lib.SPICE_SLOT_4BIT,
        "5bit": lib.SPICE_SLOT_5BIT,
    }
    assert tuple(runtime.SLOT_PRECISIONS) == SLOT_PRECISIONS == get_args(SlotPrecision)


def _counter_fields() -> tuple[str, ...]:
    from pyspice.runtime.constants import _COUNTER_FIELDS

    return _COUNTER_FIELDS


def test_python_counters_mirror_the_c_struct() -> None:
    import dataclasses

    from pyspice.stats import Counters

    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(HEADER.read_text()))
    c_fields = [name for name, _ in ffi.typeof("spice_counters").fields]
    assert c_fields == list(_counter_fields())
    assert set(c_fields) == {f.name for f in dataclasses.fields(Counters)}


def test_every_c_function_follows_the_naming_convention() -> None:
    import re

    names = re.findall(r"^SPICE_API [^;(]*?\b(\w+)\s*\(", HEADER.read_text(), flags=re.M)
    assert names, "no functions found"
    for name in names:
        assert re.fullmatch(r"spice_[a-z]+(_[a-z0-9]+)+", name), name
