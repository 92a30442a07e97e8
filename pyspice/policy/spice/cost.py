"""The cost model SPICE decides with: copy vs host vs device time, from `pyspice probe`.

All times in microseconds. The profile gives the bus (bandwidth, latency per
copy), host time per expert activation at a few batch sizes, device time per
expert and the rest of a layer's time. On a CPU-only build the device is
emulated and its compute IS the host's, on the same threads, after any wait
for copies: device work then adds to host work instead of overlapping it,
and the model says so (`overlap=False`).

Without a profile the model falls back to the emulator's default bus
(12 GB/s, 10 µs) and estimates expert time from its bytes at a nominal
host memory bandwidth; a policy works, but `pyspice probe` makes it better.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pyspice.policy.context import PolicyContext
from pyspice.policy.rule import MAX_HOST_POINTS, choose_fetches, per_activation

DEFAULT_BUS_GBPS = 12.0
DEFAULT_LATENCY_US = 10.0
NOMINAL_HOST_GBPS = 8.0  # bytes of weights a decode step streams per µs x 1e3, without a profile
NOMINAL_REST_US = 200.0


def per_expert_points(points: Sequence[tuple[int, float]], share: float) -> tuple[tuple[int, float], ...]:
    """A per-activation cost table keyed by a step's tokens -- what `pyspice probe` measures
    and the simulator's profiles give: a layer's expert time over its activations, at a
    batch of n tokens -- keyed instead by the tokens one expert runs for, which is what a
    decision about one expert weighs: at a batch of n, each expert of a layer runs about
    n x share of them (share = n_expert_used / n_expert), its weights read once for all.
    The first point (a decode step's) is one token's; points where an expert gets one
    token or fewer add nothing. At most MAX_HOST_POINTS, as the engine's rule takes."""
    pts = sorted(points)
    if not pts:
        return ()
    out = [(1, float(pts[0][1]))]
    for n, us in pts[1:]:
        m = round(n * share)
        if m > out[-1][0]:
            out.append((m, float(us)))
    return tuple(out[:MAX_HOST_POINTS])


@dataclass(frozen=True)
class CostModel:
    bus_gbps: float
    latency_us: float
    # (tokens one expert runs for, host µs per activation), ascending (per_expert_points)
    host_points: tuple[tuple[int, float], ...]
    device_expert_us: float  # one activation on the device, batch 1
    rest_us_per_layer: float  # decode: everything in a layer but the routed experts
    overlap: bool  # device and host work of one layer run at the same time
    expert_bytes: tuple[int, ...]
    measured: bool
    # a host action reads its expert from disk first (edge mode): it costs a copy too
    host_reads: bool = False

    @staticmethod
    def from_context(ctx: PolicyContext) -> CostModel:
        profile = ctx.profile
        nbytes = tuple(ctx.expert_bytes)
        if profile is None or not profile.batches:
            mean_bytes = max(1, max(nbytes, default=1))
            host = mean_bytes / (NOMINAL_HOST_GBPS * 1e3)
            bus = ctx.tier_bus if ctx.tier_bus is not None else (DEFAULT_BUS_GBPS, DEFAULT_LATENCY_US)
            return CostModel(
                bus[0],
                bus[1],
                ((1, host),),
                host,
                NOMINAL_REST_US,
                False,
                nbytes,
                False,
                host_reads=not ctx.host_weights_in_memory,
            )
        share = ctx.n_expert_used / max(1, ctx.max_expert)
        points = per_expert_points(tuple((int(b.tokens), float(b.expert_us)) for b in profile.batches), share)
        rest = float(min(profile.batches, key=lambda b: b.tokens).rest_us_per_layer)
        return CostModel(
            bus_gbps=float(profile.bus_gbps),
            latency_us=float(profile.bus_latency_us),
            host_points=points,
            device_expert_us=float(profile.device_expert_us),
            rest_us_per_layer=rest,
            overlap=not profile.device_emulated,
            expert_bytes=nbytes,
            measured=True,
            host_reads=not ctx.host_weights_in_memory,
        )

    # -- unit costs ----------------------------------------------------------------

    def copy_us(self, layer: int) -> float:
        """One expert host -> device: latency + bytes / bandwidth."""
        return self.latency_us + self.expert_bytes[layer] / (self.bus_gbps * 1e3)

    def host_us(self, n_tokens: int) -> float:
        """One expert over n_tokens tokens on the host (its weights read once for all of
        them, so the per-activation cost falls with n_tokens)."""
        return per_activation(self.host_points, n_tokens) * n_tokens

    def device_us(self, n_tokens: int) -> float:
        return self.host_us(n_tokens) if not self.overlap else self.device_expert_us * n_tokens

    def layer_us(self, n_expert_used: int) -> float:
        """T_comp: one decode step's time in one MoE layer (rest + its experts on the device)."""
        return self.rest_us_per_layer + n_expert_used * self.device_us(1)

    # -- decisions -----------------------------------------------------------------

    def h_min(self, layer: int, experts_per_layer: int, n_expert_used: int) -> int:
        """Paper eq. 4: how many layers ahead a prefetch must be issued to land in time,
        ceil(P * M_e / (B * T_comp)), with the per-copy latency included in the copy time."""
        return max(1, math.ceil(experts_per_layer * self.copy_us(layer) / self.layer_us(n_expert_used)))

    def choose_fetches(
        self,
        layer: int,
        miss_tokens: list[int],
        device_us: float,
        bus_ahead_us: float,
        margin: float,
    ) -> int:
        """How many of the misses (sorted by tokens, most first) to fetch rather than run on
        the host: the count with the least layer time, and only if it beats all-host by
        `margin` (paper section 4.3; pyspice.policy.rule.choose_fetches, the rule's too)."""
        if not miss_tokens:
            return 0
        if self.host_reads:
            return len(miss_tokens)  # the host would read the expert first: a fetch costs no more
        order = sorted(miss_tokens, reverse=True)
        return choose_fetches(
            self.copy_us(layer),
            [self.host_us(n) for n in order],
            [self.device_us(n) for n in order],
            device_us,
            bus_ahead_us,
            margin,
            self.overlap,
        )
