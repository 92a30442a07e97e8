"""spice.h's values as Python names: executors, device kinds, slot precisions, and the
fields of spice_counters in their C order."""

from __future__ import annotations

EXECUTOR_AUTO = 0  # spice_executor: the device's default
EXECUTOR_POOL = 1  # the slot-pool graph, one mul_mat_id per matrix kind per call
EXECUTOR_LEGACY = 2  # CUDA: one small graph per device expert (A/B runs)
EXECUTORS = {"auto": EXECUTOR_AUTO, "pool": EXECUTOR_POOL, "legacy": EXECUTOR_LEGACY}
DEVICE_EMULATED = 0  # spice_device_kind
DEVICE_CUDA = 1
DEVICE_DISK = 2  # slots in RAM, copies read from the model file (edge mode)

SLOT_EXACT = 0  # spice_slot_precision: slots hold the experts' own bytes
SLOT_4BIT = 1  # LOSSY: slots hold the experts re-quantized to about 4.5 bits (IQ4_NL...)
SLOT_5BIT = 2  # LOSSY: about 5.5 bits (Q5_0, else Q5_K); ~1.55x the experts of a Q8_0 model
SLOT_PRECISIONS = {"exact": SLOT_EXACT, "4bit": SLOT_4BIT, "5bit": SLOT_5BIT}

# spice_counters' fields in the struct's order (test_cffi_declarations checks them)
_COUNTER_FIELDS = (
    "hook_calls",
    "activations",
    "hits",
    "misses_fetched",
    "misses_host",
    "misses_surrogate",
    "dropped",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_cancelled",
    "bytes_h2d",
    "copy_ns",
    "stall_ns",
    "policy_ns",
    "policy_calls",
    "policy_fallbacks",
    "store_ns",
    "policy_quiet",
    "hook_ns",
    "gap_ns",
    "store_polls",
    "device_copies",
    "device_waits",
    "device_launches",
    "device_collects",
    "launch_ns",
    "collect_ns",
    "disk_read_bytes",
    "disk_reads",
    "scratch_reads",
    "scratch_ns",
    "async_posted",
    "async_skipped",
    "async_applied",
    "async_stale",
    "async_lag_calls",
    "async_wait_ns",
    "planner_ns",
    "exec_ns",
    "call_ns",
    "async_wakes",
    "rule_ns",
    "async_take_ns",
    "async_post_ns",
    "async_rows_by_hook",
)
