"""A machine's cost profile for one model, as policies and the simulator weigh it.

Measured by `pyspice probe` (pyspice.engine.probe), stored as JSON by
pyspice.formats.profile, simulated for other hardware by pyspice.sim.hardware.
Plain data, so a policy can read it with real types.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PROFILE_VERSION = 1

# How a profile's bus and device figures were obtained begins with this word
# when they stand for an emulated device (set by the user, or the host's own time).
EMULATED = "emulated"


@dataclass
class BatchCost:
    tokens: int  # tokens per micro-batch
    expert_us: float  # host time per expert activation (one token through one expert)
    rest_us_per_layer: float  # per token: everything in a layer but the routed experts


@dataclass
class CostProfile:
    version: int
    model: str
    model_sha: str  # of the first MiB: which file this profile belongs to
    threads: int
    n_layers: int
    n_moe_layers: int
    expert_bytes: dict[str, int]  # per expert, by "gate/up/down" ggml type names
    bus_gbps: float
    bus_latency_us: float
    bus_source: str  # "emulated (set by the user)" or "measured ..."
    device_expert_us: float
    device_source: str
    batches: list[BatchCost] = field(default_factory=list)
    # the model file's disk, for edge mode's tier (None: not measured)
    disk_gbps: float | None = None
    disk_latency_us: float | None = None
    # how this machine's disk reads share its cores with a decode, fitted to its own
    # edge-mode runs (`pyspice sim fit ... --save-to-probe`; pyspice.sim.fit_disk); None:
    # not fitted here, the shipped disk profile's values price it
    disk_terms: dict[str, float] | None = None

    @property
    def bus_emulated(self) -> bool:
        """The bus figures are the emulated device's, set by the user (not measured)."""
        return self.bus_source.startswith(EMULATED)

    @property
    def device_emulated(self) -> bool:
        """The device's compute is the host's own: device and host work do not overlap."""
        return self.device_source.startswith(EMULATED)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(doc: dict[str, Any]) -> CostProfile:
        batches = [BatchCost(**b) for b in doc.pop("batches", [])]
        return CostProfile(**doc, batches=batches)
