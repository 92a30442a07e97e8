"""Where SPICE policies plan (pyspice.engine.planning): which default a run takes and
how it is told, and whether an asynchronous planner may poll while idle."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pyspice.engine import planning as planning_module
from pyspice.engine.planning import Planning


def test_planning_tells_the_default_it_takes_and_only_then() -> None:
    said: list[str] = []
    assert Planning().chosen(experts_on_disk=True, say=said.append).asynchronous
    assert len(said) == 1 and "--ram-budget" in said[0] and "--planning sync" in said[0]
    assert not Planning().chosen(experts_on_disk=False, say=said.append).asynchronous
    assert len(said) == 2 and "synchronous" in said[1] and "--planning sync|async" in said[1]
    # a choice the user made is not a default: nothing to tell
    Planning(asynchronous=False).chosen(experts_on_disk=True, say=said.append)
    Planning(deterministic_lag=2).chosen(say=said.append)
    assert len(said) == 2


def test_the_planner_polls_only_with_a_core_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning_module, "usable_cores", lambda: 4)
    assert planning_module.planner_may_poll(3)
    assert not planning_module.planner_may_poll(4)  # the decode takes every core
    assert not planning_module.planner_may_poll(None)  # unknown: taken as every core
    assert Planning().params(2, idle_poll=True).idle_poll
    assert not Planning().params(2).idle_poll


def test_usable_cores_counts_the_affinity_mask() -> None:
    # a process pinned to one core has one core to use, however many the machine has
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from pyspice.engine.planning import usable_cores; print(usable_cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "1"


def test_the_default_plans_asynchronously_where_the_decode_leaves_a_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(planning_module, "usable_cores", lambda: 4)
    said: list[str] = []
    assert Planning().chosen(say=said.append, decode_threads=3).asynchronous
    assert "asynchronous" in said[0] and "3 decode threads leave it a core" in said[0]
    assert not Planning().chosen(say=said.append, decode_threads=4).asynchronous
    assert "synchronous" in said[1] and "take every core" in said[1]
    assert not Planning().chosen(decode_threads=None).asynchronous  # unknown: taken as every core
    assert not Planning(asynchronous=False).chosen(decode_threads=1).asynchronous  # the user's choice
    # the lossy levels plan asynchronously too, but deterministically, one layer late (so
    # runs repeat exactly, as they were tuned); free-running when asked, and on the disk tier
    chosen = Planning().chosen(say=said.append, decode_threads=3, lossy=True)
    assert chosen.asynchronous and chosen.deterministic_lag == planning_module.LOSSY_PLAN_LAG == 1
    assert "lossy" in said[2] and "exactly 1 MoE layer later" in said[2]
    assert chosen.expected_lag() == 1 and chosen.params(4).deterministic_lag == 1
    free = Planning(asynchronous=True).chosen(decode_threads=3, lossy=True)
    assert free.asynchronous and free.deterministic_lag == 0
    on_disk = Planning().chosen(experts_on_disk=True, decode_threads=3, lossy=True)
    assert on_disk.asynchronous and on_disk.deterministic_lag == 0
    # and synchronously where the decode takes every core, as every level
    assert not Planning().chosen(decode_threads=4, lossy=True).asynchronous
