"""Which cost profile policies weigh copies with, for the device tier in use."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pyspice.formats.profile import load_profile, profile_path
from pyspice.policy.profile import CostProfile
from pyspice.runtime import DEVICE_CUDA, DEVICE_DISK, StoreParams


def saved_profile(model_path: Path) -> CostProfile | None:
    """The profile `pyspice probe` saved for this model file, if any and readable."""
    path = profile_path(model_path)
    if not path.is_file():
        return None
    try:
        return load_profile(path)
    except (ValueError, OSError, TypeError, KeyError):
        return None  # an old or damaged profile: policies fall back to their defaults


def saved_disk(model_path: Path) -> tuple[float | None, float | None]:
    """The disk's bandwidth (GB/s) and per-read latency (us) `pyspice probe` measured
    for this model's file, or (None, None)."""
    profile = saved_profile(model_path)
    if profile is None or profile.disk_gbps is None:
        return None, None
    return profile.disk_gbps, profile.disk_latency_us


def profile_for_tier(profile: CostProfile | None, params: StoreParams | None) -> CostProfile | None:
    """`profile` as it holds for the tier `params`: a profile measured on an emulated
    bus takes the emulated tier's bus, and says nothing about a real GPU; on a disk
    tier the "bus" is the disk."""
    if profile is not None and params is not None and params.device_kind == DEVICE_DISK:
        return dataclasses.replace(
            profile,
            bus_gbps=params.bandwidth_gbps,
            bus_latency_us=params.latency_us,
            bus_source=f"disk ({params.path})",
        )
    if profile is None or not profile.bus_emulated or params is None:
        return profile
    if params.device_kind == DEVICE_CUDA:
        return None
    return dataclasses.replace(profile, bus_gbps=params.bandwidth_gbps, bus_latency_us=params.latency_us)
