"""Shared test set-up.

The reference of docs/design.md section 6 has ggml's tiled K-quant matmul OFF: for
prompt batches it rounds differently from ggml's own vec_dot path (the one
the exact executor mirrors). ggml reads GGML_CPU_TILED_MM once, so it is set
here, before any test imports llama_cpp; subprocesses inherit it.

The lossy levels' slot copies are made afresh in every test (PYSPICE_SLOT_CACHE
off): no test writes into the user's cache, and none reads another's copies.
tests/native/test_slot_cache.py turns the cache on where it is what it tests.
"""

from __future__ import annotations

import os

os.environ["GGML_CPU_TILED_MM"] = "0"
os.environ["PYSPICE_SLOT_CACHE"] = "off"
