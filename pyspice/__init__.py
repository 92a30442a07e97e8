"""pyspice: run Mixture-of-Experts models whose experts do not fit in GPU memory.

SPICE (speculative expert prefetching, low-rank expert surrogates and
cost-aware CPU/GPU orchestration) on a patched llama.cpp. See README.md and
docs/architecture.md for the map. Importing this package imports no native code; the
modules that do (runtime, api) load on first use.
"""

from typing import Any

from pyspice._version import __version__

__all__ = ["Llama", "__version__"]


def __getattr__(name: str) -> Any:
    # `pyspice.Llama` without importing native code at `import pyspice`
    if name == "Llama":
        from pyspice.api import Llama

        return Llama
    raise AttributeError(f"module 'pyspice' has no attribute {name!r}")
