"""llama.cpp's library, loaded and declared: the backend started once with llama.cpp's
log captured, where the libraries are and which CPU library runs, and the ctypes
declarations of the functions llama-cpp-python does not bind (Tandem's patches, C++
extension exports). No handles and no product rules: engine.runtime.native_model,
native_batch and native_context wrap the handles, engine.runtime.native_policy decides
what they are made with.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from engine.runtime.kernel_env import set_kernel_env

set_kernel_env()  # read once, when llama.cpp loads: set before

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

from engine.runtime.cpu_variants import (  # noqa: E402
    load_backend_libraries,
    mapped_library,
    mapped_path,
    mapped_variant,
    variants_in,
)

log = logging.getLogger(__name__)

# llama_decode's and llama_process's return codes.
DECODE_MEANINGS = {
    1: "no KV-cache slot for the batch (context full)",
    2: "aborted",
    -1: "invalid input batch",
    -100: "the decode left no logits (Tandem's greedy loop)",
}
KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
# llama.h's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a sequence's recurrent state (or window
# cache) alone, without the attention cells.
PARTIAL_STATE = 1
# The most tokens one call of the C greedy loop chooses (its buffers' size).
GREEDY_RUN_MAX = 64

_backend_lock = threading.Lock()
_backend_ready = False
# llama.cpp's recent log lines, so a load failure can say what llama.cpp objected to.
# Marks are counts of lines ever logged: the window's length stops growing once full.
_recent_native_log: deque[str] = deque(maxlen=40)
_native_log_lines = 0


def log_mark() -> int:
    """A mark to pass ``native_errors_since`` after a native call."""
    return _native_log_lines


def native_errors_since(mark: int) -> str:
    """The last error lines llama.cpp logged since ``mark``, joined ("" when none)."""
    n_new = min(_native_log_lines - mark, len(_recent_native_log))
    lines = list(_recent_native_log)[-n_new:] if n_new > 0 else []
    errors = [ln.strip() for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return "; ".join(errors[-3:])


@llama_cpp.llama_log_callback
def on_native_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _native_log_lines
    line = text.decode("utf-8", errors="replace")
    _recent_native_log.append(line)
    _native_log_lines += 1
    if level == 3:  # GGML_LOG_LEVEL_ERROR
        log.debug("llama.cpp: %s", line.rstrip())


def ensure_backend() -> None:
    """Start llama.cpp's backend once per process (log capture, a portable build's CPU
    library, the batch-invariant attention kernel on)."""
    global _backend_ready
    with _backend_lock:
        first = not _backend_ready
        if first:
            llama_cpp.llama_log_set(on_native_log, ctypes.c_void_p(0))
            load_backend_libraries(lib_dir())
            llama_cpp.llama_backend_init()
            _backend_ready = True
    if first:
        use_tiled_attention(os.environ.get("TANDEM_TILED_ATTENTION", "1") != "0")


def lib_dir() -> Path:
    """Where llama-cpp-python keeps llama.cpp's libraries."""
    return Path(llama_cpp.__file__).parent / "lib"


def llama_version() -> str:
    """The llama-cpp-python release (its vendored llama.cpp), for cache keys."""
    return str(getattr(llama_cpp, "__version__", "unknown"))


def cpu_variants() -> list[str]:
    """The instruction-set levels of a portable build's CPU libraries ("haswell", "zen4"),
    in name order; empty where the build links its CPU backend in."""
    return variants_in(lib_dir())


def loaded_cpu_variant() -> str:
    """The CPU library ggml runs in this process: a portable build's level ("haswell",
    "zen4"), or "linked" where the build links its CPU backend in (make install's)."""
    ensure_backend()
    return mapped_variant()


@functools.cache
def cpu_build_identity() -> str:
    """The CPU library this process runs and a hash of it and libllama: what an
    exactness verdict holds for. The bytes, not only the patch set: compile flags (AMX or
    not, native or portable) and the vendored llama.cpp change the sums as much."""
    digest = hashlib.sha256()
    for stem, variants in (("ggml-cpu", True), ("llama", False)):
        path = mapped_path(stem, variants)
        if path is not None:
            digest.update(Path(path).read_bytes())
    return f"{loaded_cpu_variant()}:{digest.hexdigest()[:16]}"


@functools.cache
def ggml_cpu_library() -> ctypes.CDLL | None:
    """llama.cpp's CPU backend library, the copy libllama loaded (the wheel holds the
    soname and its links as separate files: opening another would load a second
    instance, with its own switches); None where the build names it otherwise. A portable
    build's is the variant ggml loaded for this CPU."""
    ensure_backend()
    mapped = mapped_library("ggml-cpu", variants=True)
    if mapped is not None:
        return mapped
    folder = lib_dir()
    for name in ("libggml-cpu.so.0", "libggml-cpu.so", "libggml-cpu.0.dylib",
                 "libggml-cpu.dylib", "ggml-cpu.dll"):
        try:
            return ctypes.CDLL(str(folder / name))
        except OSError:
            continue
    return None


class GgmlRowKernels:
    """ggml's own SIMD row conversions (libggml-cpu), faster than numpy's for moving KV
    cells (docs/benchmarks.md: figures behind the code's rules, "Moving a prompt's
    cells")."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._to_f32 = lib.ggml_cpu_fp16_to_fp32
        self._to_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._to_f32.restype = None
        self._q8_0 = lib.quantize_row_q8_0
        self._q8_0.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._q8_0.restype = None

    def f16_to_f32(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float16)
        if out is None:
            out = np.empty(x.shape, dtype=np.float32)
        elif out.shape != x.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError("out must be a contiguous float32 array of x's shape")
        self._to_f32(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def quantize_q8_0(self, x: np.ndarray) -> np.ndarray:
        """Rows of float32 (a multiple of 32 long) -> their Q8_0 bytes."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], x.shape[1] // 32 * 34), dtype=np.uint8)
        self._q8_0(x.ctypes.data, out.ctypes.data, x.size)
        return out


@functools.cache
def ggml_row_kernels() -> GgmlRowKernels | None:
    """The CPU backend's row kernels; None where the build names them otherwise."""
    lib = ggml_cpu_library()
    try:
        return GgmlRowKernels(lib) if lib is not None else None
    except AttributeError:
        return None


@functools.cache
def prompt_kernel_switch() -> Any | None:
    """Tandem's switch for the prompt kernels (packaging/llama-cpp/prompt-kernels.patch),
    ``switch(on: bool)``, process-wide; None in a build without the patch."""
    switch = getattr(ggml_cpu_library(), "ggml_cpu_set_prompt_kernels", None)
    if switch is None:
        return None
    switch.argtypes = [ctypes.c_bool]
    switch.restype = None
    return switch


def cxx_function(name: str, argtypes: list[object], restype: object) -> Any | None:
    """A libllama function exported under its C++ (Itanium-mangled) name, as llama.cpp's
    extension functions are (llama-cpp-python binds only some); None when this build
    lacks it."""
    func = getattr(llama_cpp.llama_cpp._lib, name, None)
    if func is not None:
        func.argtypes = argtypes
        func.restype = restype
    return func


@functools.cache
def logits_row_address() -> Any:
    """``llama_get_logits_ith`` returning the address as an int: its own function object
    (``_lib[name]`` is not llama-cpp-python's binding), so nothing of theirs changes and a
    plain decoding step skips the pointer cast."""
    func = llama_cpp.llama_cpp._lib["llama_get_logits_ith"]
    func.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    func.restype = ctypes.c_void_p
    return func


@functools.cache
def greedy_run_api() -> dict[str, Any] | None:
    """Tandem's plain greedy loop and its argmax in C (packaging/llama-cpp/greedy-run.patch):
    ``{"run": ..., "argmax": ...}``, None in a build without them."""
    lib = llama_cpp.llama_cpp._lib
    run = getattr(lib, "tandem_decode_greedy", None)
    argmax = getattr(lib, "tandem_argmax", None)
    if run is None or argmax is None:
        return None
    i32, p_i32 = ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)
    run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, i32, i32, i32, p_i32, i32, p_i32,
                    ctypes.POINTER(ctypes.c_double), p_i32]
    run.restype = i32
    argmax.argtypes = [ctypes.c_void_p, i32]
    argmax.restype = i32
    return {"run": run, "argmax": argmax}


@functools.cache
def layer_input_api() -> dict[str, Any] | None:
    """The functions that export a target's layer inputs (EAGLE-3 features) and read an
    eagle3 head's layer ids; None when the library lacks any of them."""
    c_ctx, c_model = ctypes.c_void_p, ctypes.c_void_p
    api = {
        "set": cxx_function("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                            [c_ctx, ctypes.c_uint32, ctypes.c_bool], None),
        "get": cxx_function("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                            [c_ctx, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
        "ids": cxx_function("_Z28llama_model_target_layer_idsPK11llama_model",
                            [c_model], ctypes.POINTER(ctypes.c_int32)),
        "n_ids": cxx_function("_Z30llama_model_target_layer_ids_nPK11llama_model",
                              [c_model], ctypes.c_uint32),
    }
    return None if any(f is None for f in api.values()) else api


@functools.cache
def _tiled_attention_switches() -> tuple[Any, Any] | None:
    """(set, get) of the CPU library's batch-invariant attention kernel
    (packaging/llama-cpp/tiled-attention.patch); None in a build without it."""
    lib = ggml_cpu_library()
    setter = getattr(lib, "ggml_cpu_set_batch_invariant_attention", None)
    getter = getattr(lib, "ggml_cpu_get_batch_invariant_attention", None)
    if setter is None or getter is None:
        return None
    setter.argtypes, setter.restype = [ctypes.c_bool], None
    getter.argtypes, getter.restype = [], ctypes.c_bool
    return setter, getter


def use_tiled_attention(on: bool) -> None:
    """Every CPU flash-attention op of this process through the one batch-invariant
    kernel (Tandem's default; TANDEM_TILED_ATTENTION=0 keeps ggml's own three paths, for
    comparisons). A no-op in a build without it."""
    switches = _tiled_attention_switches()
    if switches is not None:
        switches[0](on)


def tiled_attention_on() -> bool:
    """Whether CPU flash attention runs the batch-invariant kernel now."""
    switches = _tiled_attention_switches()
    return switches is not None and bool(switches[1]())
