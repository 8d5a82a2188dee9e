"""Tandem's rules for llama.cpp's contexts and kernels, kept out of the wrappers: which
cache types and attention kernel a context runs (so that every batch size gives the
logits one token does), when its positions may shift, and which CPU kernels the plan
shows. ``context_params`` builds what engine.runtime.native_context.LlamaContext takes;
``NativeContext`` is a LlamaContext made by these rules, what the engine opens.
"""

from __future__ import annotations

import os

from engine.runtime.decode_gate import prompt_kernels_available
from engine.runtime.kv_cache import TYPE_K, TYPE_V
from engine.runtime.llama_bindings import ggml_cpu_library, tiled_attention_on
from engine.runtime.native_context import ContextParams, LlamaContext
from engine.runtime.native_model import NativeModel

_FLOAT_TYPES = ("f16", "f32", "bf16")


def context_params(model: NativeModel, n_ctx: int, n_batch: int, n_seq_max: int,
                   n_threads: int, features: bool, type_k: str = TYPE_K,
                   type_v: str = TYPE_V, unified_kv: bool = True, flash_attn: bool = True,
                   n_rs_seq: int = 0, op_offload: bool = True,
                   feature_layers: tuple[int, ...] = (), mtp: bool = False) -> ContextParams:
    """The parameters of a context of ``model`` by Tandem's rules, from what the caller
    asks: the cache types it names (V follows K where the model needs one type), flash
    attention as asked or where a quantized V needs it, and no shifting where llama.cpp's
    shift crashes. ``op_offload``: in a build that can offload, llama.cpp runs a batch of
    32+ tokens on the GPU even for weights kept on the CPU (fast prefill), so such a batch
    sums in another order than one token on the CPU (an H200: the probe's 33-token chain
    differed at every position, shorter ones were exact); off, every batch stays on the
    CPU. Tree verification puts one token in several sequences: ``unified_kv`` (one
    shared KV buffer); independent sequences (batched data generation) are cheaper in
    separate streams: attention then skips the other sequences' cells.

    The types: with K and V of one float type, llama.cpp's CPU flash attention takes a
    split-KV path for single-token decodes once the cache holds >= 512 cells, and a batch
    is then computed differently from the same tokens one by one (logits off by ~0.5):
    greedy speculative output would drift from plain decoding. K in Q8_0, V in F16
    (engine.runtime.kv_cache's TYPE_K, TYPE_V) keeps every batch size on one kernel
    (bit-identical logits here) at about F16's decode speed; Q8_0 V would cost more
    (docs/benchmarks.md: figures behind the code's rules, "The KV cache's types").

    Flash attention as ``choose_flash_attn`` decides for a target."""
    if model.latent_attention:
        # Its V is a view of K: llama.cpp refuses two types. Q8_0 for both keeps the
        # exact mode's one kernel for every batch size (the probe checks it).
        type_v = type_k
    return ContextParams(
        n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, n_threads=n_threads,
        type_k=type_k, type_v=type_v,
        # llama.cpp quantizes V only with flash attention.
        flash_attn=flash_attn or type_v not in _FLOAT_TYPES,
        features=features, unified_kv=unified_kv, n_rs_seq=n_rs_seq, op_offload=op_offload,
        feature_layers=tuple(feature_layers), mtp=mtp,
        # llama.cpp's K shift of a latent-attention cache in a quantized type crashes
        # (deepseek2 Q8_0 K, the differential's long chats; F16 shifts): no shift then.
        shift=not (model.latent_attention and type_k not in _FLOAT_TYPES))


def choose_flash_attn(asked: bool | None, model: NativeModel, type_k: str, type_v: str,
                      on_cpu: bool) -> bool:
    """Whether a target's context runs flash attention: as ``asked``, or (None) off where
    its layers run on this machine's CPU with the exact mode's cache (a quantized K, a
    float V), on elsewhere.

    Without it (llama-server's "auto" turns it on here) one token over a long cache is
    faster through the matrix kernels, and so is a long prompt (docs/benchmarks.md: long
    contexts). Softmax and the V sum then run over the cells in SIMD lanes, so a cell's
    lane is part of the sum: a tree's rows, which skip the other branches' cells, and
    cells a tree left parked between kept ones, sum otherwise than one token at a time
    does (the F32 case in tests/cases parted by 0.149). A chain's rows skip nothing but
    the cells after them, and its rejected tail is freed where the next step refills it
    in order, so the probe finds chains exact; a target without flash attention verifies
    chains only (``Target.trees``). Quantized V needs flash attention (llama.cpp), a
    latent-attention model's V is K's (Q8_0 in the exact mode), and on a GPU or a
    worker the matrix path was never measured: those keep it on. So does an F16 K (the
    fast mode, llama-server's cache): exact without flash attention too, but one token
    after 8k tokens took 34.9 ms against 23.5 with a Q8_0 K. And so does a
    sliding-window model (``flash_attn_by_rule``)."""
    return flash_attn_as_asked(asked, type_k, type_v, on_cpu, model.latent_attention,
                               sliding_window=model.architecture().n_swa > 0)


def flash_attn_as_asked(asked: bool | None, type_k: str, type_v: str, on_cpu: bool,
                        latent_attention: bool, sliding_window: bool = False) -> bool:
    """``choose_flash_attn`` from the settings alone (the memory plan applies it before
    the weights load): as asked, but on for a quantized V whatever was asked (llama.cpp
    needs it), and by ``flash_attn_by_rule`` when nothing was."""
    if asked is not None:
        return asked or type_v not in _FLOAT_TYPES
    return flash_attn_by_rule(type_k, type_v, on_cpu, latent_attention, sliding_window)


def flash_attn_by_rule(type_k: str, type_v: str, on_cpu: bool, latent_attention: bool,
                       sliding_window: bool = False) -> bool:
    """The rule when nothing was asked (``flash_attn_as_asked``). A sliding-window model
    keeps it on: the cache holds every
    position (``swa_full``), and flash attention skips the cells outside a windowed
    layer's window (the CPU kernel skips masked cells and whole masked tiles) where the
    matrix path computes them all, so its windowed layers cost a window, not the context
    (a Gemma 3 1B shape after 8k tokens: prompts 327-366 tok/s against 280-295, decoding
    72.6-80.4 against 69.9-73.5).

    On this machine's CPU with Tandem's attention kernel (packaging/llama-cpp/
    tiled-attention.patch) it is on for every cache type: one kernel for every batch size,
    bit-identical rows whatever the batch (trees included: a row's masked cells add
    nothing), and faster than the matrix path (docs/benchmarks.md: "One attention
    kernel")."""
    if sliding_window or (on_cpu and tiled_attention_on()):
        return True
    return not (on_cpu and type_v in _FLOAT_TYPES and type_k not in _FLOAT_TYPES
                and not latent_attention)


def trees_exact(flash_attn: bool, n_gpu_layers: int, n_layer: int) -> bool:
    """Whether a target's attention sums a tree's rows as one token at a time sums them:
    with flash attention (``choose_flash_attn``), and where no layer runs through Tandem's
    CPU kernel (packaging/llama-cpp/tiled-attention.patch). That kernel is exact for
    every batch of cells laid out as one token at a time lays them out, but its 64-cell
    tiles and vector sums are anchored at cell indices, and a tree leaves its kept tokens
    between freed or parked cells (a noisy tree's answer parted from plain decoding at
    token 34): layers on this machine's CPU (a worker runs the same library) verify
    chains, whose cells match. Every layer on a GPU (``n_gpu_layers`` > ``n_layer``)
    keeps trees."""
    return flash_attn and not tiled_cpu_attention(flash_attn, n_gpu_layers, n_layer)


def tiled_cpu_attention(flash_attn: bool, n_gpu_layers: int, n_layer: int) -> bool:
    """Whether some layer's attention runs through the tiled CPU kernel: flash attention
    on, the kernel on, and not every layer offloaded to a GPU."""
    return flash_attn and tiled_attention_on() and n_gpu_layers <= n_layer


class NativeContext(LlamaContext):
    """A context made by ``context_params``'s rules (its arguments: see there)."""

    def __init__(self, model: NativeModel, n_ctx: int, n_batch: int, n_seq_max: int,
                 n_threads: int, features: bool, type_k: str = TYPE_K, type_v: str = TYPE_V,
                 unified_kv: bool = True, flash_attn: bool = True, n_rs_seq: int = 0,
                 op_offload: bool = True, feature_layers: tuple[int, ...] = (),
                 ctx_other: LlamaContext | None = None, mtp: bool = False) -> None:
        """Raises ModelLoadError when llama.cpp cannot create the context (memory).
        ``ctx_other``: the target context an eagle3 head borrows its token embedding and
        LM head from (it must outlive this one). ``mtp``: a context that runs the model's
        next-token block instead of its trunk (the model must be loaded with
        ``load_mtp``; its KV holds that block's layer only)."""
        params = context_params(model, n_ctx, n_batch, n_seq_max, n_threads, features,
                                type_k=type_k, type_v=type_v, unified_kv=unified_kv,
                                flash_attn=flash_attn, n_rs_seq=n_rs_seq,
                                op_offload=op_offload, feature_layers=feature_layers,
                                mtp=mtp)
        super().__init__(model, params, ctx_other=ctx_other)


def kernel_settings(repack: bool) -> dict[str, object]:
    """The CPU kernel switches a model runs with, as the plan shows them: weight
    repacking (per model load), the tiled K-quant matmul and op fusion (per process,
    from the environment: engine.runtime.kernel_env), and llamafile's sgemm (the build).
    Where the build has Tandem's switch (see the Makefile), the first two are on for
    prompts only."""
    tiled = os.environ.get("GGML_CPU_TILED_MM", "1").strip() not in ("0", "")
    fusion = os.environ.get("GGML_CPU_DISABLE_FUSION", "0")
    prompts: object = "prompts" if prompt_kernels_available() else False
    lib = ggml_cpu_library()
    sgemm = lib is not None and bool(getattr(lib, "ggml_cpu_has_llamafile", lambda: 0)())
    return {"repack": repack, "tiled_matmul": tiled or prompts,
            "fusion": fusion.strip() in ("0", ""), "llamafile_sgemm": sgemm and prompts}
