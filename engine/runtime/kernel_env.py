"""Process-wide CPU kernel choices that llama.cpp reads from the environment once, so they
are made before it loads (engine.runtime.llama_bindings calls ``set_kernel_env`` before
it imports llama_cpp)."""

from __future__ import annotations

import os

# One summation order for every decode and verification batch size (the lossless
# contract; engine.runtime.exactness probes it): ggml's tiled K-quant matmul takes batches
# of 8 rows or more and sums in another order than the one-token kernel. Read once per
# process, at the first matmul, so it is set before llama.cpp loads. A user's own setting
# stands (the probe then tells whether output stays exact).
TILED_MM_SET_BY_USER = "GGML_CPU_TILED_MM" in os.environ


def set_kernel_env() -> None:
    """Tandem's settings where the user made none (idempotent)."""
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
