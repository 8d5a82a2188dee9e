"""llama.cpp's native side, in layers (llama-cpp-python's ``_internals`` as the model),
and the one place the rest of Tandem imports it from:

- bindings: ``llama_bindings`` (the library loaded, llama.cpp's log captured, ctypes
  declarations of what llama-cpp-python does not bind), ``cpu_variants`` (a portable
  build's CPU libraries), ``kernel_env`` (kernel settings made before llama.cpp loads);
- thin wrappers that own native handles and take explicit parameters: ``native_model``
  (NativeModel, NativeGrammar), ``native_batch`` (NativeBatch, NativeExtBatch),
  ``native_context`` (LlamaContext over ContextParams, GreedyRun), ``native_quantize``;
  ``decode_gate``: which decodes run at once (prompt kernels: alone);
- policy: ``native_policy`` (the cache types, flash attention and shift rule a context
  gets, the kernels the plan shows; ``NativeContext``, a context made by those rules).

With engine.runtime.native_rpc (ggml's device and RPC functions) and
engine.runtime.repack_check (a self-check of the CPU library's repacked kernels), these
are the only modules of Tandem that touch ctypes. Above them everything is
``list[int]``, numpy arrays and plain Python values. Each owner has an idempotent
``close()`` and works as a context manager.
"""

from __future__ import annotations

from engine.runtime.cpu_variants import CPU_VARIANT_ENV, mapped_library
from engine.runtime.decode_gate import (
    DECODE_GATE,
    DecodeGate,
    prompt_kernels,
    prompt_kernels_available,
)
from engine.runtime.kernel_env import TILED_MM_SET_BY_USER
from engine.runtime.llama_bindings import (
    GREEDY_RUN_MAX,
    PARTIAL_STATE,
    GgmlRowKernels,
    cpu_build_identity,
    cpu_variants,
    ensure_backend,
    ggml_cpu_library,
    ggml_row_kernels,
    lib_dir,
    llama_version,
    loaded_cpu_variant,
)
from engine.runtime.llama_bindings import on_native_log as _on_native_log
from engine.runtime.native_batch import NativeBatch, NativeExtBatch
from engine.runtime.native_context import ContextParams, GreedyRun, LlamaContext, native_argmax
from engine.runtime.native_model import (
    NativeGrammar,
    NativeModel,
    control_tokens,
    json_object_gbnf,
    json_schema_gbnf,
    utf8_bytes,
)
from engine.runtime.native_policy import (
    NativeContext,
    choose_flash_attn,
    context_params,
    kernel_settings,
    trees_exact,
)
from engine.runtime.native_quantize import FTYPE_Q4_0, FTYPES, ftype_named, quantize

__all__ = [
    "CPU_VARIANT_ENV", "DECODE_GATE", "FTYPES", "FTYPE_Q4_0", "GREEDY_RUN_MAX",
    "PARTIAL_STATE", "TILED_MM_SET_BY_USER", "ContextParams", "DecodeGate", "GgmlRowKernels",
    "GreedyRun", "LlamaContext", "NativeBatch", "NativeContext", "NativeExtBatch",
    "NativeGrammar", "NativeModel", "_on_native_log", "choose_flash_attn", "context_params",
    "control_tokens",
    "cpu_build_identity", "cpu_variants", "ensure_backend", "ftype_named",
    "ggml_cpu_library", "ggml_row_kernels", "json_object_gbnf", "json_schema_gbnf",
    "kernel_settings", "lib_dir", "llama_version", "loaded_cpu_variant", "mapped_library",
    "native_argmax", "prompt_kernels", "prompt_kernels_available", "quantize", "trees_exact",
    "utf8_bytes",
]
