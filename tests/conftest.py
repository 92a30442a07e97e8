"""Shared test set-up.

The reference of DESIGN section 6 has ggml's tiled K-quant matmul OFF: for
prompt batches it rounds differently from ggml's own vec_dot path (the one
the exact executor mirrors). ggml reads GGML_CPU_TILED_MM once, so it is set
here, before any test imports llama_cpp; subprocesses inherit it.
"""

from __future__ import annotations

import os

os.environ["GGML_CPU_TILED_MM"] = "0"
