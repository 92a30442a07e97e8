"""Side-by-side measurement of policies on one loaded model, in one process.

Every policy runs on the same prompt and decodes the same number of tokens
greedily (argmax of the logits, so lossless policies must produce the same
tokens). Repeats interleave the policies, rotating their order, so slow
drift of a shared machine spreads over all of them; times are reported as
the median of the repeats with their spread, and compared as ratios to a
baseline inside the run. Nothing here asserts a time.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspice.engine.decode_trace import greedy_next
from pyspice.engine.planning import Planning
from pyspice.measure.device_bytes import BufferReport, device_bytes, device_match_lines, llama_buffer_report
from pyspice.measure.upstream_rows import UPSTREAM_ROWS, UpstreamRow
from pyspice.policy.registry import AUTO
from pyspice.policy.rows import PolicyRow, parse_row

# The prompt every policy runs when none is given (and the simulator's recorded workload).
DEFAULT_PROMPT = (
    "The history of computing is a story of machines that grew smaller, faster and more capable, "
    "from rooms full of vacuum tubes to processors that fit in a pocket. Each generation"
)


@dataclass(frozen=True)
class BenchConfig:
    policies: tuple[PolicyRow, ...]  # results are keyed by their labels
    prompt_tokens: tuple[int, ...]
    n_predict: int
    repeat: int = 3
    # how the llama.cpp rows of `policies` load, or why they cannot run (upstream_rows.plan_row);
    # a llama.cpp row without a plan runs as `upstream` always has: upstream's defaults
    upstream: dict[str, UpstreamRow] = field(default_factory=dict)
    replaying: bool = False  # hooked rows replay a routing trace (their outputs are timing only)
    model_buffers: BufferReport | None = None  # llama.cpp's buffers of the pyspice model


@dataclass
class PolicyResult:
    name: str
    prefill_tps: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    tokens_consistent: bool = True  # same tokens in every repeat
    policy_us: list[float] = field(default_factory=list)  # per decode hook call, each repeat
    label: str = ""  # the table's name (a llama.cpp row's placement); "" = name
    skipped: str | None = None  # why the row did not run here
    timing_only: bool = False  # replayed routing: outputs are not the model's, tokens not compared
    device: dict[str, int] = field(default_factory=dict)  # device bytes (device_bytes.device_bytes)

    @property
    def shown(self) -> str:
        return self.label or self.name

    def record(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"label": self.shown, "skipped": self.skipped}
        rec = dict(self.stats)
        rec["label"] = self.shown
        rec["device_bytes"] = self.device
        if self.timing_only:
            rec["timing_only"] = True
        if self.policy_us:  # noisy on shared machines: the median of the repeats, like TPOT
            rec["policy_us_per_decode_call"] = median(self.policy_us)
            rec["policy_us_per_decode_call_runs"] = self.policy_us
        rec["tpot_ms"] = median(self.tpot_ms)
        rec["prefill_tps"] = median(self.prefill_tps)
        rec["tpot_ms_runs"] = self.tpot_ms
        rec["prefill_tps_runs"] = self.prefill_tps
        rec["tokens"] = self.tokens
        return rec


def fit_prompt(tokens: Sequence[int], n: int) -> tuple[int, ...]:
    """The prompt repeated or cut to exactly `n` tokens, its first (BOS) kept once
    (n = 0: as given)."""
    prompt = tuple(tokens)
    if n <= 0:
        return prompt
    body = prompt[1:] or prompt
    reps = n // len(body) + 1
    return (prompt[:1] + body * reps)[:n]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how much the repeats disagree."""
    m = median(values)
    return (max(values) - min(values)) / m if values and m else 0.0


def row_planning(row: PolicyRow) -> Planning | None:
    """Where a bench row plans (None: as the run does), so one run compares synchronous
    and asynchronous planning of the same policy."""
    if row.planning is None:
        return None
    return Planning(asynchronous=row.planning == "async", deterministic_lag=row.plan_lag)


def split_row(text: str) -> tuple[str, Planning | None]:
    """A row's policy name and planning from its text, for scripts that take a row as
    text (tools/tune-lookahead.py); pyspice itself passes parsed rows."""
    row = parse_row(text, UPSTREAM_ROWS)
    return row.name, row_planning(row)


def baseline_label(text: str) -> str:
    """--baseline as the rows label it (`spice@plan=async` is the row `spice@async`); a
    name the grammar refuses is kept, to be named as not among the rows."""
    try:
        return parse_row(text, UPSTREAM_ROWS).label
    except ValueError:
        return text.strip()


def check_in_process_rows(rows: Sequence[PolicyRow]) -> None:
    """Rows that one loaded model can run: its tiers are the command's, and llama.cpp's
    rows have no hook to plan in."""
    for row in rows:
        if row.ram is not None or row.device is not None:
            raise ValueError(
                f"row {row.label!r}: a budget of the row's own needs --memory-limit (each row in its "
                "own process); in one process every row has --ram-budget/--device-budget"
            )
        if row.spec is None and row.planning is not None:
            raise ValueError(
                f"row {row.label!r}: llama.cpp's own row has no hook to plan in; write {row.name!r}"
            )


def run_one(
    llm: Any,
    row: PolicyRow,
    cfg: BenchConfig,
    default_planning: Planning | None = None,
    twins: UpstreamTwins | None = None,
) -> tuple[float, float, list[int], dict[str, Any]]:
    """One repeat of one row: (prefill tok/s, TPOT ms, generated ids, stats record).
    A row that does not say where it plans plans as `default_planning` says (None: as
    the engine does now); a llama.cpp row runs its model of `twins`."""
    if row.name in UPSTREAM_ROWS:
        return _run_plain((twins or UpstreamTwins(llm, cfg.upstream)).get(row.name), cfg)
    planning = row_planning(row)
    chosen = planning if planning is not None else default_planning
    if chosen is not None:
        llm.spice_engine.planning = chosen  # set_policy below enables the policy with it
    llm.set_policy(row.name)
    llm.reset()
    llm.spice_reset_stats()
    llm.spice_engine.replay_prompt()  # every row and repeat replays the same routing
    llm.eval(list(cfg.prompt_tokens))
    llm.spice_engine.replay_decode(len(cfg.prompt_tokens))
    prompt = llm.spice_stats()
    tokens = [greedy_next(llm)]
    for _ in range(cfg.n_predict - 1):
        llm.eval([tokens[-1]])
        tokens.append(greedy_next(llm))
    stats = llm.spice_stats()
    stats["policy_us_per_decode_call"] = _decode_share(stats, prompt)
    stats["per_call_decode"] = decode_per_call(stats, prompt)
    stats["decode_hit_rate"] = decode_hit_rate(stats, prompt)
    stats["decode_misses"] = decode_misses(stats, prompt)
    stats["planner_wait_us_per_decode_call"] = decode_planner_wait(stats, prompt)
    choice = llm.spice_auto_choice if row.name == AUTO else None
    if choice is not None:
        stats["auto"] = choice.record()  # what the row ran, and the simulated ranking it chose by
    return float(stats["prefill_tps"]), float(stats["tpot_ms"]), tokens, stats


def _decode_share(total: dict[str, Any], prompt: dict[str, Any]) -> float:
    """Policy microseconds per decode hook call: the whole run's less the prompt's (a
    prompt batch's call plans for many tokens and costs accordingly). Every hook call
    is served by the policy, asked or decided in advance, so calls = hook_calls."""
    return _decode_mean(total["policy_us_per_call"], prompt["policy_us_per_call"], total, prompt)


def _decode_mean(
    total_mean: float, prompt_mean: float, total: dict[str, Any], prompt: dict[str, Any]
) -> float:
    """A per-hook-call mean over the decode calls alone, from the whole run's and the
    prompt's means (0 when nothing was decoded)."""
    n_all, n_prompt = total["hook_calls"], prompt["hook_calls"]
    calls = n_all - n_prompt
    return (total_mean * n_all - prompt_mean * n_prompt) / calls if calls > 0 else 0.0


def decode_per_call(total: dict[str, Any], prompt: dict[str, Any]) -> dict[str, float]:
    """The per_call record of the decode hook calls alone (the whole run's less the
    prompt's). A prompt batch's call costs many decode calls' worth (asynchronous
    planning copies every row of its snapshot), so per_call, averaged over every call,
    is not comparable with policy_us_per_decode_call: accounting check
    (tools/hook-thread-rows.py) compares these."""
    return {
        key: _decode_mean(value, prompt["per_call"][key], total, prompt)
        for key, value in total["per_call"].items()
    }


def decode_planner_wait(total: dict[str, Any], prompt: dict[str, Any]) -> float:
    """Microseconds per decode hook call the hook thread waited for a plan due at that
    call (deterministic planning), the prompt's calls left out: the planner plans a
    prompt batch's snapshot of every row, far longer than a decode step's."""

    def wait(stats: dict[str, Any]) -> float:
        return float((stats.get("planning") or {}).get("wait_us_per_call") or 0.0)

    return _decode_mean(wait(total), wait(prompt), total, prompt)


def decode_hit_rate(total: dict[str, Any], prompt: dict[str, Any]) -> float:
    """Hit rate of the decode steps alone: the whole run's hits and activations less the
    prompt's. The run's hit_rate is mostly the prompt's (a 128-token prompt has 4x the
    activations of 32 decoded tokens), and at a small budget the prompt batch, which
    touches most experts of every layer, misses nearly everywhere; the simulator's and
    the issue's hit rates are those of decoding."""
    acts = int(total["activations"]) - int(prompt["activations"])
    hits = round(total["hit_rate"] * total["activations"]) - round(prompt["hit_rate"] * prompt["activations"])
    return hits / acts if acts > 0 else 0.0


def decode_misses(total: dict[str, Any], prompt: dict[str, Any]) -> dict[str, int]:
    """The decode steps' misses by outcome (fetched, host, surrogate): the whole run's
    less the prompt's. A 128-token prompt's batch has 4x the activations of 32 decoded
    tokens and, on an empty tier, runs a policy's first layers on the host whatever it
    is; what a level changes in decoding shows here."""
    whole, first = total.get("misses") or {}, prompt.get("misses") or {}
    return {key: int(whole.get(key, 0)) - int(first.get(key, 0)) for key in ("fetched", "host", "surrogate")}


class UpstreamTwins:
    """The plain llama.cpp models of a run's llama.cpp rows, each loaded on first use
    with what llama.cpp reported allocating for it (device_bytes.llama_buffer_report)."""

    def __init__(self, llm: Any, rows: dict[str, UpstreamRow]) -> None:
        self.llm, self.rows = llm, rows
        self.buffers: dict[str, BufferReport] = {}

    def get(self, name: str) -> Any:
        row = self.rows.get(name)  # None: upstream's defaults
        ngl, overrides = (row.n_gpu_layers, row.overrides) if row is not None else (None, ())
        if name in self.buffers:
            return self.llm.spice_upstream_twin(ngl, overrides)
        with llama_buffer_report() as report:
            twin = self.llm.spice_upstream_twin(ngl, overrides)
        self.buffers[name] = report
        return twin


def _run_plain(plain: Any, cfg: BenchConfig) -> tuple[float, float, list[int], dict[str, Any]]:
    plain.reset()
    start = time.perf_counter()
    plain.eval(list(cfg.prompt_tokens))
    prefill_s = time.perf_counter() - start
    tokens = [greedy_next(plain)]
    decode_s = 0.0
    for _ in range(cfg.n_predict - 1):
        start = time.perf_counter()
        plain.eval([tokens[-1]])
        decode_s += time.perf_counter() - start
        tokens.append(greedy_next(plain))
    pps = len(cfg.prompt_tokens) / prefill_s
    tpot = decode_s * 1e3 / max(1, cfg.n_predict - 1)
    return pps, tpot, tokens, {"tpot_ms": tpot, "prefill_tps": pps, "hook_calls": 0, "hit_rate": 0.0}


def run_bench(
    llm: Any, cfg: BenchConfig, progress: Callable[[str], None] | None = None
) -> dict[str, PolicyResult]:
    """Every row of `cfg`, by label."""
    check_in_process_rows(cfg.policies)
    results = {row.label: _result(row, cfg) for row in cfg.policies}
    runs = tuple(row for row in cfg.policies if results[row.label].skipped is None)
    n = len(runs)
    default_planning = llm.spice_engine.planning  # the run's, for rows that do not say
    twins = UpstreamTwins(llm, cfg.upstream)

    for r in range(cfg.repeat):
        order = runs[r % n :] + runs[: r % n]
        for row in order:
            if progress:
                progress(f"repeat {r + 1}/{cfg.repeat}: {row.label}")
            pps, tpot, tokens, stats = run_one(llm, row, cfg, default_planning, twins)
            res = results[row.label]
            res.prefill_tps.append(pps)
            res.tpot_ms.append(tpot)
            if res.tokens and res.tokens != tokens:
                res.tokens_consistent = False
            res.tokens = tokens
            res.stats = stats
            res.policy_us.append(float(stats.get("policy_us_per_decode_call", 0.0)))
    for row in runs:
        results[row.label].device = _device_bytes(llm, row, cfg, twins)
    return results


def _result(row: PolicyRow, cfg: BenchConfig) -> PolicyResult:
    """An empty result for `row`: its label, and why it is skipped, if it is."""
    planned = cfg.upstream.get(row.name)
    if planned is not None:
        return PolicyResult(row.label, label=planned.label, skipped=planned.skip)
    hooked = row.name not in UPSTREAM_ROWS and row.name != "stock"
    return PolicyResult(row.label, timing_only=hooked and cfg.replaying)


def _device_bytes(llm: Any, row: PolicyRow, cfg: BenchConfig, twins: UpstreamTwins) -> dict[str, int]:
    """What `row` holds on the device: a llama.cpp row its model's device buffers; a
    pyspice row the pyspice model's, and the tier's slots unless it is `stock`."""
    if row.name in UPSTREAM_ROWS:
        return device_bytes(twins.buffers.get(row.name))
    runtime = llm.spice_engine.runtime
    uses_tier = row.name != "stock" and runtime is not None
    return device_bytes(cfg.model_buffers, runtime.slot_pool_bytes() if uses_tier else 0)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "-"


def _same_tokens(res: PolicyResult, base: PolicyResult | None) -> str:
    if res.timing_only:
        return "timing only"
    if base is None or base.timing_only:
        return "-"
    return "yes" if res.tokens == base.tokens else "NO"


def format_table(results: dict[str, PolicyResult], baseline: str) -> str:
    """Median and best of the repeats, each with its ratio to the baseline's, the stats
    record's traffic columns (from the last repeat) and each row's device bytes; rows
    that cannot run here say why."""
    base = results.get(baseline)
    b_pps = (median(base.prefill_tps), max(base.prefill_tps)) if base else (0.0, 0.0)
    b_tpot = (median(base.tpot_ms), min(base.tpot_ms)) if base else (0.0, 0.0)
    width = max([18, *(len(res.shown) for res in results.values())])
    header = (
        f"{'policy':<{width}} {'prefill tok/s':>13} {'x ' + baseline:>11} {'TPOT ms':>9} {'best':>8} "
        f"{'x ' + baseline:>11} {'spread':>7} {'hit':>6} {'dec hit':>7} {'fetch/host/surr':>17} "
        f"{'MiB/tok':>8} {'stall ms/tok':>12} {'pol us/call':>11} {'store us':>8} {'wait us':>7} {'lag':>5} "
        f"{'stale':>6} "
        f"{'dev MiB':>9} {'same tokens':>11}"
    )
    lines = [header, "-" * len(header)]
    for res in results.values():
        if res.skipped is not None:
            lines.append(f"{res.shown:<{width}} skipped: {res.skipped}")
            continue
        pps, pps_best = median(res.prefill_tps), max(res.prefill_tps)
        tpot, tpot_best = median(res.tpot_ms), min(res.tpot_ms)
        st = res.stats
        misses = st.get("misses", {})
        pps_ratio = _ratio(pps, b_pps[0]) + "/" + _ratio(pps_best, b_pps[1])
        tpot_ratio = _ratio(tpot, b_tpot[0]) + "/" + _ratio(tpot_best, b_tpot[1])
        outcome = f"{misses.get('fetched', 0)}/{misses.get('host', 0)}/{misses.get('surrogate', 0)}"
        planning = st.get("planning", {})
        lag = f"{planning['lag_layers']:.1f}" if planning.get("asynchronous") else "-"
        stale = str(planning.get("stale", 0)) if planning.get("asynchronous") else "-"
        # the hook waiting for a deterministic plan: not deciding, but the hook thread's time
        wait = (
            f"{st.get('planner_wait_us_per_decode_call', 0.0):.1f}" if planning.get("asynchronous") else "-"
        )
        # the store's own time (issuing and polling copies, evicting): not deciding, but the hook
        # thread's, and on a real GPU 9-18 us per copy (docs/results/gpu.md)
        store = (st.get("per_call_decode") or st.get("per_call") or {}).get("store_us", 0.0)
        lines.append(
            f"{res.shown:<{width}} {pps:>13.1f} {pps_ratio:>11} {tpot:>9.3f} {tpot_best:>8.3f} "
            f"{tpot_ratio:>11} {spread(res.tpot_ms):>6.1%} {st.get('hit_rate', 0.0):>6.3f} "
            f"{st.get('decode_hit_rate', 0.0):>7.3f} {outcome:>17} "
            f"{st.get('bytes_per_token', 0.0) / 2**20:>8.2f} {st.get('stall_ms_per_token', 0.0):>12.3f} "
            f"{median(res.policy_us) if res.policy_us else 0.0:>11.1f} {store:>8.1f} {wait:>7} {lag:>5} "
            f"{stale:>6} "
            f"{res.device.get('total', 0) / 2**20:>9.1f} {_same_tokens(res, base):>11}"
        )
    lines.append(
        f"(prefill: median, x {baseline} = median ratio/best ratio, above 1 is faster; TPOT: median and "
        "best, below 1 is faster; spread = (max-min)/median of TPOT; hit: prompt and decode, dec hit: "
        "decode steps only; misses as fetched/host/surrogate; "
        "pol us/call: the hook thread's deciding time per decode hook call (the policy when "
        "synchronous; posting snapshots, applying plans and the rule when asynchronous), median of "
        "the repeats; store us: the store's own time per decode hook call (issuing and polling copies, "
        "evicting; not deciding), last repeat; wait us: the hook thread waiting per decode hook call "
        "for a plan due now "
        "(deterministic planning, NAME@detK and the lossy levels' default), last repeat; "
        "lag: layers from a snapshot to its plan's use, stale: plans dropped as too late; "
        "dev MiB: device memory as llama.cpp reports its buffers (weights, KV cache, compute) plus "
        "the device tier's slots (an emulated tier's are host memory standing in for them); "
        "timing only: routing replayed from a trace, outputs not the model's)"
    )
    lines.extend(device_match_lines({n: r.device for n, r in results.items() if r.skipped is None}))
    return "\n".join(lines)


def plot(results: dict[str, PolicyResult], baseline: str, path: str, title: str) -> None:
    # lazy: matplotlib is optional, for --plot only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {n: r for n, r in results.items() if r.skipped is None}
    names = list(results)
    pps = [median(results[n].prefill_tps) for n in names]
    tpot = [median(results[n].tpot_ms) for n in names]
    pps_err = [
        [median(r.prefill_tps) - min(r.prefill_tps) for r in results.values()],
        [max(r.prefill_tps) - median(r.prefill_tps) for r in results.values()],
    ]
    tpot_err = [
        [median(r.tpot_ms) - min(r.tpot_ms) for r in results.values()],
        [max(r.tpot_ms) - median(r.tpot_ms) for r in results.values()],
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(4 + 1.6 * len(names), 4))
    labels = [results[n].shown for n in names]
    ax1.bar(labels, pps, yerr=pps_err, color="tab:blue", capsize=4)
    ax1.set_title("prefill tokens/s (higher is better)")
    ax2.bar(labels, tpot, yerr=tpot_err, color="tab:orange", capsize=4)
    ax2.set_title("decode TPOT ms (lower is better)")
    base = results.get(baseline)
    for ax, values, ref in (
        (ax1, pps, median(base.prefill_tps) if base else 0),
        (ax2, tpot, median(base.tpot_ms) if base else 0),
    ):
        for i, v in enumerate(values):
            if ref:
                ax.annotate(f"x{v / ref:.3f}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stderr_progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)
