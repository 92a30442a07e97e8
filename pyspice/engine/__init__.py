"""The engine under `pyspice.Llama`, and the one run configuration.

engine.py     Engine: device tier, surrogates, cost profile, policy lifecycle, stats
config.py     RunConfig -> ResolvedRun: every default resolved in one place
device.py     DeviceTier: a budget's sizing, and the memory checks that refuse it
surrogates.py loading a sidecar's surrogates, cut to a share of the budget
profile.py    the cost profile policies weigh copies with, for the tier in use
"""

from pyspice.engine.config import ResolvedRun, RunConfig
from pyspice.engine.device import DeviceTier
from pyspice.engine.engine import Engine
from pyspice.engine.surrogates import SurrogateSet

__all__ = ["DeviceTier", "Engine", "ResolvedRun", "RunConfig", "SurrogateSet"]
