"""The SPICE policy: one policy class, configured per quality level and ablation."""

from pyspice.policy.spice.config import ABLATIONS, QUALITY_LEVELS, SpiceConfig, spice_config
from pyspice.policy.spice.policy import SpicePolicy

__all__ = ["ABLATIONS", "QUALITY_LEVELS", "SpiceConfig", "SpicePolicy", "spice_config"]
