"""spice-pool-ids-check (native/tools/spice-pool-ids-check.c): the slot-pool graph's
expert ids over random calls. MUL_MAT_ID wants each token's ids distinct; ggml-cuda's
batched kernel broke on a token whose pairs off the device all pointed at the zero
slot (on an H200, 2026-12-04: device rows 0.6-3.2x the host's largest value apart in
9-32-token calls). A CPU build cannot show that, so the rule is checked here directly:
device pairs keep their slots, no token of a several-token launch repeats an id, a
one-token launch reads no real slot for a pair off the device."""

from __future__ import annotations

import subprocess

from pyspice.build_info import load_build_info


def test_every_token_gets_distinct_ids_and_device_pairs_keep_their_slots() -> None:
    tool = load_build_info().tool("spice-pool-ids-check")
    for seed in ("1", "2", "3"):
        done = subprocess.run([str(tool), "20000", seed], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "all checks passed" in done.stdout
