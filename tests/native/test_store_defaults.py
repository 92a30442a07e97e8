"""spice_store_default_params: the store's defaults stated once, in libspice. StoreParams
takes every default from it, and the simulator's twin tier queues as many prefetches."""

from __future__ import annotations

import dataclasses

from pyspice.runtime import DEVICE_EMULATED, EXECUTOR_AUTO, SLOT_EXACT, Store, StoreParams
from pyspice.runtime.loader import _Native
from pyspice.sim import tier

INVALID_ARG = 1


def _c_defaults() -> dict[str, object]:
    n = _Native.get()
    p = n.ffi.new("spice_store_params *")
    assert n.lib.spice_store_default_params(p) == 0
    out: dict[str, object] = {}
    for name, _ in n.ffi.typeof("spice_store_params").fields:
        value = getattr(p, name)
        out[name] = None if name == "path" and value == n.ffi.NULL else value
    return out


def test_python_defaults_are_the_c_ones() -> None:
    c = _c_defaults()
    py = StoreParams(budget_bytes=c["budget_bytes"])  # type: ignore[arg-type]
    fields = {f.name for f in dataclasses.fields(StoreParams)}
    assert fields == set(c), "StoreParams and spice_store_params name different fields"
    assert {name: getattr(py, name) for name in fields} == {
        name: bool(v) if name == "manual_clock" else v for name, v in c.items()
    }


def test_the_c_defaults_are_the_documented_ones() -> None:
    # spice.h lists these; a changed default is a changed header comment too
    assert _c_defaults() == {
        "budget_bytes": 0,
        "bandwidth_gbps": 16.0,
        "latency_us": 10.0,
        "prefetch_queue_max": 64,
        "manual_clock": 0,
        "device_kind": DEVICE_EMULATED,
        "device_index": 0,
        "path": None,
        "io_threads": 4,
        "io_fault_after": 0,
        "executor": EXECUTOR_AUTO,
        "exec_fault_after": 0,
        "slot_precision": SLOT_EXACT,
    }
    assert _c_defaults()["prefetch_queue_max"] == tier.PREFETCH_QUEUE_DEFAULT


def test_no_struct_to_fill_is_refused() -> None:
    n = _Native.get()
    assert n.lib.spice_store_default_params(n.ffi.NULL) == INVALID_ARG


def test_a_store_made_from_the_defaults_and_a_budget_works() -> None:
    store = Store(StoreParams(budget_bytes=4 * 4096), [8, 8], [4096, 4096])
    assert store.n_slots == 4
