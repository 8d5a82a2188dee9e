"""Whether a model fits a device's memory: the one rule the planner, the session, the model
wizard and a lost worker's fallback use, so a wizard's label and a plan cannot disagree.

What a target needs on one device is its weights with a margin, its KV cache (exact, from
the header: ``engine.runtime.kv_cache``) and llama.cpp's compute buffers. The margin
scales with the model, not with the device: what llama.cpp adds to a file's bytes grows
with the file, while a fraction of free memory (the wizard's old 90%) would hold back
8 GiB of an 80 GiB GPU for nothing. It fits a GPU when that need is at most the free
VRAM, read just before the load; it fits the RAM when it is at most four fifths of the
available RAM, which the OS, this app and the user's other programs share and grow into.
"""

from __future__ import annotations

# The weights: a tenth for what llama.cpp allocates beyond the file's bytes (alignment,
# buffers sized by the weights); the margin the planner and the session placed targets by.
WEIGHTS_MARGIN = 1.1
# llama.cpp's compute buffers (a batch's activations and logits), which the planner's
# rule left out: one allowance for any model, the one the wizard's label had.
COMPUTE_OVERHEAD_BYTES = 256 * 2**20
# Tandem's torch draft head on a device: its weights, its copy of the target's embedding
# and LM head (counted in its size), and the workspace of its levels.
HEAD_MARGIN = 1.3
# A draft model llama.cpp runs: its weights and its compute buffers (it batches little).
DRAFT_MARGIN = 1.2
# The share of available RAM a model may take; the rest stays with the OS and programs.
RAM_HEADROOM = 0.8


def target_need(weights_bytes: float, kv_bytes: float) -> int:
    """Bytes a target (or any model llama.cpp runs whole) needs on one device: weights
    with the margin, its KV cache and the compute buffers."""
    return int(weights_bytes * WEIGHTS_MARGIN + kv_bytes) + COMPUTE_OVERHEAD_BYTES


def draft_need(weights_bytes: float, kv_bytes: float) -> int:
    """Bytes a draft model needs beside the target: weights with its margin and its own
    KV cache."""
    return int(weights_bytes * DRAFT_MARGIN + kv_bytes)


def head_need(head_bytes: float) -> int:
    """Bytes Tandem's torch draft head needs on a device (0 for no head)."""
    return int(head_bytes * HEAD_MARGIN)


def fits_gpu(need: float, free_vram: float) -> bool:
    """Whether ``need`` bytes fit a device's free memory: a GPU's, or what workers
    report free (their devices give it as a GPU does)."""
    return need <= free_vram


def fits_ram(need: float, available_ram: float) -> bool:
    """Whether ``need`` bytes fit this machine's available RAM, leaving its headroom."""
    return need <= available_ram * RAM_HEADROOM


def layers_that_fit(weights_bytes: float, kv_bytes: float, n_layers: int,
                    free_bytes: float) -> int:
    """How many of a target's ``n_layers`` fit ``free_bytes`` of a device (0 to
    ``n_layers``): each layer takes an equal share of the weights with the margin and of
    the KV cache, and the compute buffers come first. All of them fit exactly when
    ``fits_gpu(target_need(weights_bytes, kv_bytes), free_bytes)``."""
    n = max(1, n_layers)
    if fits_gpu(target_need(weights_bytes, kv_bytes), free_bytes):
        return n_layers
    per_layer = (weights_bytes * WEIGHTS_MARGIN + kv_bytes) / n
    left = free_bytes - COMPUTE_OVERHEAD_BYTES
    return max(0, min(n_layers, int(left // per_layer))) if per_layer > 0 else 0


__all__ = ["COMPUTE_OVERHEAD_BYTES", "DRAFT_MARGIN", "HEAD_MARGIN", "RAM_HEADROOM",
           "WEIGHTS_MARGIN", "draft_need", "fits_gpu", "fits_ram", "head_need",
           "layers_that_fit", "target_need"]
