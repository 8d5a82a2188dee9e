"""How a target is opened: its context, cache, kernels and prompt machinery, and where its
layers run (``engine.runtime.target.Target`` takes one)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.kv_cache import TYPE_K, TYPE_V


@dataclass(frozen=True)
class TargetConfig:
    n_ctx: int = 4096
    n_threads: int | None = None  # None: one per physical core
    n_batch: int = 256  # prefill chunk; also the largest verification batch
    n_seq_max: int = 16  # sequences: a tree may have n_seq_max - 1 leaves (one parks)
    features: bool = False  # post-norm hidden states, for a draft head
    type_k: str = TYPE_K  # KV-cache types; NativeContext says why K is not f16
    type_v: str = TYPE_V
    n_gpu_layers: int = 0  # layers offloaded to a GPU (llama.cpp builds that can)
    # One KV buffer for all sequences (tree verification needs it); False gives each
    # sequence its own stream, cheaper for independent sequences (training data).
    unified_kv: bool = True
    # None: off where the target runs on this machine's CPU with a float V cache (one
    # token over a long cache decodes faster through the matrix kernels, and prompts read
    # faster), on elsewhere; off, drafts are verified as chains only
    # (engine.runtime.native_policy.choose_flash_attn says why).
    flash_attn: bool | None = None
    # Long prompts are prefilled in a second, F16/F16 context and moved into this one
    # (engine.runtime.kv_transfer says why); off, or when it cannot apply, they are prefilled here.
    f16_prefill: bool = True
    # llama.cpp's repacked weights (engine.runtime.native.NativeModel); the exactness
    # probe turns them off for weight types whose batches then sum in another order.
    repack: bool = True
    # The largest verification batch whose rows are one-token decoding's (the exactness
    # probe's verdict: repacked weights run batches of up to 3 rows through the one-row
    # kernel, 4 and more through another); None: any batch.
    max_batch: int | None = None
    # Recurrent-state snapshots on hybrid models, so a rejected draft can be taken back:
    # every decode then copies the state (docs/benchmarks.md: hybrids' snapshots), so
    # plain-only targets go without.
    state_snapshots: bool = True
    # Batches of a CPU-resident target on the GPU (llama.cpp's op offload, builds that can
    # offload): fast, but not the sums one-token decoding makes on the CPU. None: off
    # while the target is wholly on the CPU (verification then equals plain decoding),
    # on when layers are on the GPU anyway. The F16 prefill context keeps it on: plain
    # and drafted answers share that prefill.
    op_offload: bool | None = None
    # Prompts prefilled in the F16 context by a second copy of the weights where the
    # target's own layout is the slower one for prompts (engine.runtime.prompt_weights):
    # plain weights for the tiled matmul beside a repacked K-quant target (mmapped, so
    # they share the file's page cache; docs/benchmarks.md: reading prompts), or,
    # without the prompt kernels, a repacked copy beside a target that runs
    # without repacking, where memory has room for it. Verification keeps the target's
    # own kernels; plain and drafted answers share the prefill, so they stay identical.
    prefill_copy: bool = True
    # llama.cpp's fastest batch kernels for prompts (llamafile's sgemm, the tiled K-quant
    # matmul), where the build has Tandem's switch (engine.runtime.native.prompt_kernels;
    # docs/benchmarks.md: reading prompts). Verification never uses them.
    prompt_kernels: bool = True
    # The GGUF's next-token (MTP) layers, for the MTP drafter: loaded where the file has
    # them (one block of weights more; the target's own decoding never runs it).
    load_mtp: bool = True
    # Workers (HOST:PORT, engine.workers) whose devices take the target's layers, and how
    # many layers go there (-1: all, the output layer included). Open such a target in a
    # child process (engine.session_process): a lost worker aborts the process.
    workers: tuple[str, ...] = ()
    worker_layers: int = -1
    # The output layer (the LM head, and the embeddings tied to it) kept here while the
    # layers are on workers: an EAGLE-3 head's graph uses it, and llama.cpp aborts on a
    # weight in a worker's buffer there. Hidden states then cross the network, not logits.
    output_here: bool = False
