#!/usr/bin/env python3
"""hook-thread table from rounds of `pyspice bench --json` at one budget.

For each row: the hook thread's deciding time per decode call (median of the rounds,
each round's listed), TPOT over `exact`'s in the same round, the decode hit rate, the
asynchronous rows' lag, stale plans and waits for a deterministic plan not done yet
(not deciding, but the hook thread's time), the whole run's host-executed activations
and the decode steps' (bench since); then the accounting check: how much of the
row's whole hook time over `exact`'s is neither deciding, nor the store's bookkeeping
and copy work, nor waits for copies (the residual; 0 when the counters account for
everything the hook thread does). The last column takes each row's expert execution
out first (per_call exec_us: thread 0 from the end of planning to return, and launch_us:
queueing the device's pairs just before that), which the
issue's arithmetic assumes equal to `exact`'s; it is not where a row runs its experts
from slots instead of the host's weights, or runs fewer of them (surrogates). Where
the record has per_call call_us (the steps every policy's calls take alike: reading
the call, checking ids, booking, preparing the executors), that is taken out too,
so what is left is hook time that no counter names.

Every figure is of the decode calls alone where the record has `per_call_decode`
(bench since). Older records only have `per_call`, averaged over every
call, prompt batches included, against deciding time of decode calls alone: an
asynchronous row's prompt batch copies every row of its snapshot, which showed as
2-3 us per call of "residual" that was no decode call's (the script says when it
falls back to `per_call`).

    for r in 1 2 3; do
      pyspice bench -m smolmoe-b --policies exact,lru,... --device-budget 25% \
          -n 32 --repeat 2 -t 1 --json > r$r.json
    done
    tools/hook-thread-rows.py r1.json r2.json r3.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def load(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text())["policies"] for p in paths]


def residual(row: dict[str, Any], exact: dict[str, Any], n_moe: int, less_named: bool = False) -> float:
    """Hook time over exact's, less deciding, bookkeeping and copy waits (us per call);
    with less_named, each row's expert execution and shared per-call steps taken out of its
    hook time first."""
    if "stall_us" in per_call(row):  # the decode calls' own waits (records since)
        waits = per_call(row)["stall_us"] - per_call(exact)["stall_us"]
    else:  # the whole run's, prompt included, over the decoded tokens' calls
        waits = row["stall_ms_per_token"] * 1e3 / n_moe  # a decoded token makes n_moe calls
    waits += row.get("planner_wait_us_per_decode_call", 0.0)  # deterministic plans not done yet

    def hook_us(r: dict[str, Any]) -> float:
        pc = per_call(r)
        # launch_us: queueing the device's pairs, which thread 0 does after the first barrier
        # and before exec_us starts (launch_device_work): expert execution too, on a GPU
        # 5-60 us a call, on an emulated tier none
        named = (
            pc.get("exec_us", 0.0) + pc.get("call_us", 0.0) + pc.get("launch_us", 0.0) if less_named else 0.0
        )
        return float(pc["hook_us"] - named)

    hook = hook_us(row) - hook_us(exact)
    deciding = row["policy_us_per_decode_call"] - exact["policy_us_per_decode_call"]
    store = per_call(row)["store_us"] - per_call(exact)["store_us"]
    return float(hook - deciding - store - waits)


def per_call(row: dict[str, Any]) -> dict[str, float]:
    """The row's per-call figures of decode calls alone, where the record has them."""
    return dict(row.get("per_call_decode") or row["per_call"])


def print_host_cuts(hosts: dict[str, tuple[float, float | None]]) -> None:
    """The lossy levels earn their loss: each lossy row's cut in host-executed
    activations against the lossless level planned the same way (`spice:fast@sync` against
    `spice:exact@sync`), whole run and decode steps, of the medians."""
    for name, (host, dec) in hosts.items():
        level, _, how = name.partition("@")
        if level not in ("spice:balanced", "spice:fast"):
            continue
        lossless = "spice:exact" + (f"@{how}" if how else "")
        base = hosts.get(lossless)
        if base is None or not base[0]:
            continue
        whole = 1.0 - host / base[0]
        decode = f"{1.0 - dec / base[1]:.1%}" if dec is not None and base[1] else "-"
        print(f"host cut of {name} against {lossless}: whole run {whole:.1%}, decode {decode}")


def deciding_parts(records: list[dict[str, Any]]) -> str:
    """The deciding time's parts, medians of the rounds (per_call_decode's rule_us, take_us,
    post_us,; merging the plans' lists is the rest), or '-' for records
    without them."""
    per_call = [r.get("per_call_decode") or {} for r in records]
    if not all("rule_us" in c for c in per_call):
        return "-"
    med = statistics.median
    return " / ".join(f"{med(c[k] for c in per_call):.2f}" for k in ("rule_us", "take_us", "post_us"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rounds", type=Path, nargs="+", help="bench --json files, one per round, same budget")
    ap.add_argument("--moe-layers", type=int, default=30, help="MoE layers per token (smolmoe-b: 30)")
    args = ap.parse_args()
    rounds = load(args.rounds)
    # llama.cpp's own rows (upstream-*) never call the hook: nothing of theirs to account for
    hooked = [n for n in rounds[0] if "per_call" in rounds[0][n] or "per_call_decode" in rounds[0][n]]
    names = [n for n in hooked if all(n in r for r in rounds)]
    med = statistics.median
    print(
        "| row | hook us (rounds) | rule / take / post us | planner wait us | TPOT / exact | decode hit | "
        "host activations (decode) | lag | stale | residual us (rounds) | "
        "residual less exec and call us (rounds) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    hosts: dict[str, tuple[float, float | None]] = {}
    for name in names:
        us = [r[name]["policy_us_per_decode_call"] for r in rounds]
        ratio = [r[name]["tpot_ms"] / r["exact"]["tpot_ms"] for r in rounds]
        hit = [r[name]["decode_hit_rate"] for r in rounds]
        plans = [r[name].get("planning") or {} for r in rounds]
        is_async = bool(plans[0].get("asynchronous"))
        lag = f"{statistics.mean(p['lag_layers'] for p in plans):.2f}" if is_async else "-"
        stale = str(sum(p["stale"] for p in plans)) if is_async else "-"
        wait = med(r[name].get("planner_wait_us_per_decode_call", 0.0) for r in rounds)
        host = med(r[name]["misses"].get("host", 0) for r in rounds)
        dec = [r[name].get("decode_misses", {}).get("host") for r in rounds]
        dec_host = med(d for d in dec if d is not None) if all(d is not None for d in dec) else None
        hosts[name] = (host, dec_host)
        parts = deciding_parts([r[name] for r in rounds])
        res = [residual(r[name], r["exact"], args.moe_layers) for r in rounds]
        rex = [residual(r[name], r["exact"], args.moe_layers, less_named=True) for r in rounds]
        print(
            f"| {name} | {med(us):.2f} ({', '.join(f'{u:.2f}' for u in us)}) | {parts} | "
            f"{f'{wait:.2f}' if is_async else '-'} | {med(ratio):.3f} | "
            f"{med(hit):.3f} | {host:.0f} ({'-' if dec_host is None else f'{dec_host:.0f}'}) | "
            f"{lag} | {stale} | "
            f"{med(res):.1f} ({', '.join(f'{v:.1f}' for v in res)}) | "
            f"{med(rex):.1f} ({', '.join(f'{v:.1f}' for v in rex)}) |"
        )
    print_host_cuts(hosts)
    different = [n for n in names if any(r[n].get("tokens") != r["exact"].get("tokens") for r in rounds)]
    tpot = ", ".join(f"{r['exact']['tpot_ms']:.2f}" for r in rounds)
    print(f"\nexact's TPOT ms per round: {tpot}")
    print(f"rows whose tokens differ from exact's: {', '.join(different) or 'none'}")
    if any("per_call_decode" not in r[n] for r in rounds for n in names):
        print("per-call figures: every call's, prompt batches included (records before per_call_decode)")
    else:
        print("per-call figures: decode calls alone (per_call_decode)")


if __name__ == "__main__":
    main()
