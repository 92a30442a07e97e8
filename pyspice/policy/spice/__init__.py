"""The SPICE policy: one policy class, configured per quality level and ablation."""

from pyspice.policy.spice.config import (
    ABLATIONS,
    LEVEL_BOUNDS,
    QUALITY_LEVELS,
    SpiceConfig,
    SurrogateThresholds,
    level_config,
    spice_config,
)
from pyspice.policy.spice.policy import SpicePolicy

__all__ = [
    "ABLATIONS",
    "LEVEL_BOUNDS",
    "QUALITY_LEVELS",
    "SpiceConfig",
    "SpicePolicy",
    "SurrogateThresholds",
    "level_config",
    "spice_config",
]
