"""pyspice: run Mixture-of-Experts models whose experts do not fit in GPU memory.

SPICE (speculative expert prefetching, low-rank expert surrogates and
cost-aware CPU/GPU orchestration) on a patched llama.cpp. See README.md and
DESIGN.md for the map. Importing this package imports no native code; the
modules that do (runtime, api) load on first use.
"""

from pyspice._version import __version__

__all__ = ["__version__"]
