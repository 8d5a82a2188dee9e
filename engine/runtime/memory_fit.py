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

from dataclasses import dataclass

# The weights: a tenth for what llama.cpp allocates beyond the file's bytes (alignment,
# buffers sized by the weights); the margin the planner and the session placed targets by.
WEIGHTS_MARGIN = 1.1
# llama.cpp's compute buffers (a batch's activations and logits), which the planner's
# rule left out: one allowance for any model, the one the wizard's label had.
COMPUTE_OVERHEAD_BYTES = 256 * 2**20
# The same on this machine's CPU, measured: llama.cpp's compute buffer (~50 MiB with
# 256-token batches and flash attention, on every model tried) and the host buffers
# beside it (outputs, the sampler, threads). A process's peak less the parts counted
# apart was 97-116 MiB: the bundled model after 2k and 8k tokens, a 1.7B shape after 8k
# (`tandem bench --long-context`); the GPU allowance over-counted the bundled model 1.3x.
CPU_COMPUTE_BYTES = 112 * 2**20
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


# Bytes of one attention score: without flash attention llama.cpp writes a batch's
# scores over the whole cache as F32 (its compute buffer grows with the context: the
# bundled model at 8k, 256-token batches, 9 heads: 83 MiB off against 49 on).
SCORE_BYTES = 4


def attention_scores_bytes(n_batch: int, n_ctx: int, n_heads: int, flash_attn: bool) -> int:
    """What a context's compute buffer holds beyond the allowance for a batch's attention
    scores: ``n_batch`` rows over ``n_ctx`` cells per head without flash attention,
    nothing with it (it walks the cells a block at a time)."""
    return 0 if flash_attn else n_batch * n_ctx * n_heads * SCORE_BYTES


@dataclass(frozen=True)
class MemoryNeed:
    """What a loaded target and its drafters take of a device, in bytes, by part."""

    weights: int  # the file's bytes with the margin
    kv: int  # the decoding context's cache
    # the F16 context long prompts are read in: its cache and the buffers of a move
    prefill_kv: int = 0
    attention: int = 0  # scores without flash attention, every context that runs it
    drafters: int = 0  # a draft head's or a draft model's weights and cache
    compute: int = COMPUTE_OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return (self.weights + self.kv + self.prefill_kv + self.attention + self.drafters
                + self.compute)

    def parts(self) -> dict[str, int]:
        """Each part by name, and the total (for plans, JSON and the dashboard)."""
        return {"weights": self.weights, "kv_cache": self.kv, "prefill_cache": self.prefill_kv,
                "attention_scores": self.attention, "drafters": self.drafters,
                "compute": self.compute, "total": self.total}

    def describe(self) -> str:
        """``1.2 GiB (weights 0.5, KV cache 0.4, ...)`` for a plan or a refusal."""
        named = [("weights", self.weights), ("KV cache", self.kv),
                 ("prompt cache", self.prefill_kv), ("attention scores", self.attention),
                 ("drafters", self.drafters), ("buffers", self.compute)]
        inner = ", ".join(f"{name} {n / 2**30:.2f}" for name, n in named if n)
        return f"{self.total / 2**30:.2f} GiB ({inner})"


def context_memory(weights_bytes: float, kv_bytes: float, *, prefill_kv_bytes: float = 0,
                   n_batch: int = 0, n_ctx: int = 0, n_heads: int = 0,
                   flash_attn: bool = True, drafter_bytes: float = 0,
                   on_cpu: bool = True) -> MemoryNeed:
    """A target's need at its context, every part counted: the decoding cache, the F16
    context's (``prefill_kv_bytes``; 0 where prompts are read in place), the attention
    scores of each context without flash attention, the drafters', and the compute
    buffers (measured on the CPU; the allowance elsewhere)."""
    n_contexts = 2 if prefill_kv_bytes else 1
    return MemoryNeed(
        weights=int(weights_bytes * WEIGHTS_MARGIN), kv=int(kv_bytes),
        prefill_kv=int(prefill_kv_bytes),
        attention=n_contexts * attention_scores_bytes(n_batch, n_ctx, n_heads, flash_attn),
        drafters=int(drafter_bytes),
        compute=CPU_COMPUTE_BYTES if on_cpu else COMPUTE_OVERHEAD_BYTES)


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


__all__ = ["COMPUTE_OVERHEAD_BYTES", "CPU_COMPUTE_BYTES", "DRAFT_MARGIN", "HEAD_MARGIN",
           "RAM_HEADROOM", "SCORE_BYTES", "WEIGHTS_MARGIN", "MemoryNeed", "attention_scores_bytes",
           "context_memory", "draft_need", "fits_gpu", "fits_ram", "head_need",
           "layers_that_fit", "target_need"]
