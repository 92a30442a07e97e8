"""Pythonic handles over libspice's C API (cffi, ABI mode): the only package that touches it.

Its modules' public names, re-exported: `from pyspice.runtime import Runtime`.
"""

from pyspice.runtime.constants import (
    DEVICE_CUDA,
    DEVICE_DISK,
    DEVICE_EMULATED,
    EXECUTOR_AUTO,
    EXECUTOR_LEGACY,
    EXECUTOR_POOL,
    EXECUTORS,
    SLOT_4BIT,
    SLOT_5BIT,
    SLOT_EXACT,
    SLOT_PRECISIONS,
)
from pyspice.runtime.errors import DecodeFailedError, IncompatibleModelError, SpiceError
from pyspice.runtime.handle import LayerInfo
from pyspice.runtime.hook import Runtime
from pyspice.runtime.loader import cdef_from_header, native
from pyspice.runtime.ops import add_outcomes, device_count, device_memory, rule_router_logits, surrogate_apply
from pyspice.runtime.plans import plan_check
from pyspice.runtime.store import AsyncParams, ExpertBufferType, Store, StoreParams

__all__ = [
    "DEVICE_CUDA",
    "DEVICE_DISK",
    "DEVICE_EMULATED",
    "EXECUTORS",
    "EXECUTOR_AUTO",
    "EXECUTOR_LEGACY",
    "EXECUTOR_POOL",
    "SLOT_4BIT",
    "SLOT_5BIT",
    "SLOT_EXACT",
    "SLOT_PRECISIONS",
    "AsyncParams",
    "DecodeFailedError",
    "ExpertBufferType",
    "IncompatibleModelError",
    "LayerInfo",
    "Runtime",
    "SpiceError",
    "Store",
    "StoreParams",
    "add_outcomes",
    "cdef_from_header",
    "device_count",
    "device_memory",
    "native",
    "plan_check",
    "rule_router_logits",
    "surrogate_apply",
]
