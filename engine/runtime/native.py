"""Owners of llama.cpp's native handles. With engine.runtime.native_rpc (ggml's device and
RPC functions) and engine.runtime.repack_check (a self-check of the CPU library's repacked
kernels), the only modules of Tandem that touch ctypes.

Above this layer everything is ``list[int]``, numpy arrays and plain Python values.
Each owner has an idempotent ``close()`` and works as a context manager.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# One summation order for every decode and verification batch size (the lossless
# contract; engine.runtime.exactness probes it): ggml's tiled K-quant matmul takes batches
# of 8 rows or more and sums in another order than the one-token kernel. Read once per
# process, at the first matmul, so it is set before llama.cpp loads. A user's own setting
# stands (the probe then tells whether output stays exact).
TILED_MM_SET_BY_USER = "GGML_CPU_TILED_MM" in os.environ
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

from engine.errors import ClosedError, ContextFullError, ModelLoadError, NativeError  # noqa: E402
from engine.gguf.check import why_unloadable  # noqa: E402
from engine.gguf.draft_compat import VOCAB_TYPES, VocabFacts  # noqa: E402
from engine.gguf.header import check_gguf_magic  # noqa: E402
from engine.runtime.architecture import ArchitectureFacts  # noqa: E402

log = logging.getLogger(__name__)

_DECODE_MEANINGS = {
    1: "no KV-cache slot for the batch (context full)",
    2: "aborted",
    -1: "invalid input batch",
    -100: "the decode left no logits (Tandem's greedy loop)",
}

_KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
# llama.h's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a sequence's recurrent state (or window
# cache) alone, without the attention cells.
PARTIAL_STATE = 1

# Names one CPU library of a portable build to load instead of the best this CPU runs.
CPU_VARIANT_ENV = "TANDEM_CPU_VARIANT"
_CPU_VARIANT_PREFIX = "libggml-cpu-"

_backend_lock = threading.Lock()
_backend_ready = False
# llama.cpp's recent log lines, so a load failure can say what llama.cpp objected to.
# Marks are counts of lines ever logged: the window's length stops growing once full.
_recent_native_log: deque[str] = deque(maxlen=40)
_native_log_lines = 0


def _log_mark() -> int:
    return _native_log_lines


@llama_cpp.llama_log_callback
def _on_native_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _native_log_lines
    line = text.decode("utf-8", errors="replace")
    _recent_native_log.append(line)
    _native_log_lines += 1
    if level == 3:  # GGML_LOG_LEVEL_ERROR
        log.debug("llama.cpp: %s", line.rstrip())


def ensure_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_on_native_log, ctypes.c_void_p(0))
            _load_backend_libraries()
            llama_cpp.llama_backend_init()
            _backend_ready = True


def lib_dir() -> Path:
    """Where llama-cpp-python keeps llama.cpp's libraries."""
    return Path(llama_cpp.__file__).parent / "lib"


def cpu_variants() -> list[str]:
    """The instruction-set levels of a portable build's CPU libraries ("haswell", "zen4"),
    in name order; empty where the build links its CPU backend in."""
    return sorted(p.name[len(_CPU_VARIANT_PREFIX):-len(".so")]
                  for p in lib_dir().glob(f"{_CPU_VARIANT_PREFIX}*.so"))


def _load_backend_libraries() -> None:
    """A portable build (GGML_BACKEND_DL: the packaged build, packaging/dist) keeps its
    backends as libraries ggml loads at run time, one CPU library per instruction-set
    level, of which it takes the best this CPU runs. ggml looks for them beside the
    executable and in the working directory, not where llama-cpp-python keeps them.
    ``TANDEM_CPU_VARIANT`` names one level to load instead of the best (the variants
    check runs each level this CPU can run in turn)."""
    wanted = os.environ.get(CPU_VARIANT_ENV)
    if not cpu_variants():
        if wanted:
            raise ModelLoadError(f"{CPU_VARIANT_ENV}={wanted}: this llama.cpp build links "
                                 "one CPU backend in; levels are a portable build's "
                                 "(make dist)")
        return  # the CPU backend is linked in (make install's build)
    ggml = mapped_library("ggml")
    load_all = getattr(ggml, "ggml_backend_load_all_from_path", None)
    if load_all is None:
        raise ModelLoadError("this llama.cpp build keeps its CPU backend in libraries "
                             "but cannot load them (no ggml_backend_load_all_from_path)")
    load_all.argtypes, load_all.restype = [ctypes.c_char_p], None
    load_all(str(_one_variant_folder(wanted) if wanted else lib_dir()).encode())
    if wanted and _mapped_path("ggml-cpu", variants=True) is None:
        raise ModelLoadError(f"this CPU cannot run llama.cpp's {wanted} CPU library "
                             f"({CPU_VARIANT_ENV}={wanted})")


def _one_variant_folder(level: str) -> Path:
    """A folder where ggml finds the backends of ``lib_dir()`` with one CPU library: ggml
    loads the best-scoring CPU library of a folder, so this is how to pick a lower one."""
    if level not in cpu_variants():
        raise ModelLoadError(f"{CPU_VARIANT_ENV}={level}: this build's CPU libraries are "
                             f"{', '.join(cpu_variants())}")
    folder = Path(tempfile.mkdtemp(prefix=f"tandem-cpu-{level}-"))
    atexit.register(shutil.rmtree, folder, True)
    for lib in lib_dir().glob("libggml-*.so"):
        is_cpu = lib.name.startswith(_CPU_VARIANT_PREFIX)
        if lib.name == f"{_CPU_VARIANT_PREFIX}{level}.so" or (
                not is_cpu and lib.name not in ("libggml-base.so", "libggml.so")):
            (folder / lib.name).symlink_to(lib)
    return folder


def _mapped_path(stem: str, variants: bool = False) -> str | None:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None  # not Linux: the caller falls back to names
    for line in maps.splitlines():
        path = line.rpartition(" ")[2]
        name = os.path.basename(path)
        if name.startswith(f"lib{stem}.so") or (variants and name.startswith(f"lib{stem}-")):
            return path
    return None


def mapped_library(stem: str, variants: bool = False) -> ctypes.CDLL | None:
    """The copy of ``lib<stem>`` (with ``variants``, also ``lib<stem>-<level>.so``, what
    a portable build loads) this process has already mapped: opening it by that path
    returns the loaded copy's handle, never a second instance with its own state."""
    path = _mapped_path(stem, variants)
    return ctypes.CDLL(path) if path is not None else None


def loaded_cpu_variant() -> str:
    """The CPU library ggml runs in this process: a portable build's level ("haswell",
    "zen4"), or "linked" where the build links its CPU backend in (make install's)."""
    ensure_backend()
    path = _mapped_path("ggml-cpu", variants=True)
    name = os.path.basename(path) if path is not None else ""
    if name.startswith(_CPU_VARIANT_PREFIX):
        return name[len(_CPU_VARIANT_PREFIX):].split(".so")[0]
    return "linked"


@functools.cache
def cpu_build_identity() -> str:
    """The CPU library this process runs and a hash of it and libllama: what an
    exactness verdict holds for. The bytes, not only the patch set: compile flags (AMX or
    not, native or portable) and the vendored llama.cpp change the sums as much."""
    digest = hashlib.sha256()
    for stem, variants in (("ggml-cpu", True), ("llama", False)):
        path = _mapped_path(stem, variants)
        if path is not None:
            digest.update(Path(path).read_bytes())
    return f"{loaded_cpu_variant()}:{digest.hexdigest()[:16]}"


def _native_errors_since(mark: int) -> str:
    n_new = min(_native_log_lines - mark, len(_recent_native_log))
    lines = list(_recent_native_log)[-n_new:] if n_new > 0 else []
    errors = [ln.strip() for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return "; ".join(errors[-3:])


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


@functools.cache
def ggml_row_kernels() -> GgmlRowKernels | None:
    """The CPU backend's row kernels; None where the build names them otherwise."""
    lib = ggml_cpu_library()
    try:
        return GgmlRowKernels(lib) if lib is not None else None
    except AttributeError:
        return None


# Held while the prompt kernels are on, and by every decode: a decode on another thread
# (a draft model's, a head's, a second target's) waits rather than run with them.
_PROMPT_KERNELS_HELD = threading.RLock()
_prompt_kernel_depth = 0  # nested blocks (one thread: the lock's holder) turn them off once


@functools.cache
def _prompt_kernel_switch() -> ctypes._CFuncPtr | None:
    """Tandem's switch for the prompt kernels (packaging/llama-cpp/prompt-kernels.patch);
    None in a build without the patch."""
    switch = getattr(ggml_cpu_library(), "ggml_cpu_set_prompt_kernels", None)
    if switch is None:
        return None
    switch.argtypes = [ctypes.c_bool]
    switch.restype = None
    return switch


def prompt_kernels_available() -> bool:
    return _prompt_kernel_switch() is not None


@contextlib.contextmanager
def prompt_kernels(on: bool = True) -> Iterator[bool]:
    """llama.cpp's fastest batch kernels for the decodes inside (this thread's; others
    wait): llamafile's sgemm (float, Q8_0, Q5_0, Q4_0 weights) and the tiled K-quant
    matmul (K-quants that are not repacked), for faster prompts (docs/benchmarks.md:
    figures behind the code's rules, "Reading prompts"). A batch of 2+ rows then
    sums in another order than one token, so only a prefill that plain and drafted
    answers share may use them, never a verification. Yields whether they are on."""
    switch = _prompt_kernel_switch() if on else None
    if switch is None:
        yield False
        return
    global _prompt_kernel_depth
    with _PROMPT_KERNELS_HELD:
        if _prompt_kernel_depth == 0:
            switch(True)
        _prompt_kernel_depth += 1
        try:
            yield True
        finally:
            _prompt_kernel_depth -= 1
            if _prompt_kernel_depth == 0:
                switch(False)


def utf8_bytes(text: str) -> bytes:
    """``text`` as UTF-8 for llama.cpp. Bytes that were not valid UTF-8 (a command line's
    surrogate escapes, lone surrogates from JSON) become U+FFFD, as an editor shows them,
    rather than a codec error."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:  # argv and stdin carry invalid bytes as surrogate escapes: recover them
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # other lone surrogates
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace").encode("utf-8")


def _cxx_function(name: str, argtypes: list[object], restype: object) -> object | None:
    """A libllama function exported under its C++ (Itanium-mangled) name, as llama.cpp's
    extension functions are (llama-cpp-python binds only some); None when this build
    lacks it."""
    func = getattr(llama_cpp.llama_cpp._lib, name, None)
    if func is not None:
        func.argtypes = argtypes
        func.restype = restype
    return func


@functools.cache
def _logits_row_address() -> Any:
    """``llama_get_logits_ith`` returning the address as an int: its own function object
    (``_lib[name]`` is not llama-cpp-python's binding), so nothing of theirs changes and a
    plain decoding step skips the pointer cast."""
    func = llama_cpp.llama_cpp._lib["llama_get_logits_ith"]
    func.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    func.restype = ctypes.c_void_p
    return func


# The most tokens one call of the C greedy loop chooses (its buffers' size).
GREEDY_RUN_MAX = 64


@functools.cache
def _greedy_run_api() -> Any | None:
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


def native_argmax(row: np.ndarray) -> int:
    """The C loop's argmax of a float32 row (the first maximum, a NaN the largest: as
    numpy's). Raises RuntimeError in a build without it."""
    api = _greedy_run_api()
    if api is None:
        raise RuntimeError("this llama.cpp build lacks Tandem's greedy loop")
    row = np.ascontiguousarray(row, dtype=np.float32)
    return int(api["argmax"](row.ctypes.data, row.size))


class GreedyRun:
    """The C greedy loop over one batch and stop set, its buffers made once."""

    @staticmethod
    def available() -> bool:
        return _greedy_run_api() is not None

    def __init__(self, batch: NativeBatch, stop: frozenset[int]) -> None:
        api = _greedy_run_api()
        if api is None:
            raise RuntimeError("this llama.cpp build lacks Tandem's greedy loop")
        self._run = api["run"]
        self._batch = batch
        self.stop = stop
        self._stop = (ctypes.c_int32 * max(1, len(stop)))(*sorted(stop))
        self._n_stop = len(stop)
        self._out = (ctypes.c_int32 * GREEDY_RUN_MAX)()
        self._seconds = (ctypes.c_double * GREEDY_RUN_MAX)()
        self._status = ctypes.c_int32()

    def __call__(self, ctx: NativeContext, token: int, pos: int, n_max: int
                 ) -> tuple[list[int], list[float], int]:
        """Decode ``token`` at ``pos`` in ``ctx``'s sequence 0, then each chosen token, up to
        ``n_max`` (1 to GREEDY_RUN_MAX) choices or a stop token (chosen, not decoded).
        Returns the tokens chosen, each one's seconds (its decode and choice) and the return
        code of a decode that failed after the first (0: none did; else the run ended
        early, and its cells past the chosen tokens are the caller's to drop). Raises
        ContextFullError or NativeError when the first decode fails."""
        if not 1 <= n_max <= GREEDY_RUN_MAX:
            raise ValueError(f"a greedy run chooses 1 to {GREEDY_RUN_MAX} tokens, not {n_max}")
        # Held for the whole run (about 50 ms): a decode on another thread waits that long.
        with _PROMPT_KERNELS_HELD:
            n = self._run(ctx.handle, ctypes.byref(self._batch.raw), token, pos, n_max,
                          self._stop, self._n_stop, self._out, self._seconds,
                          ctypes.byref(self._status))
        rc = self._status.value
        if n == 0:
            ctx.last_batch_start = pos
            ctx._check("llama_decode", rc, 1, "batch")
        ctx.last_batch_start = pos + n - 1
        return self._out[:n], self._seconds[:n], rc


@functools.cache
def _layer_input_api() -> dict[str, object] | None:
    """The functions that export a target's layer inputs (EAGLE-3 features) and read an
    eagle3 head's layer ids; None when the library lacks any of them."""
    c_ctx, c_model = ctypes.c_void_p, ctypes.c_void_p
    api = {
        "set": _cxx_function("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                             [c_ctx, ctypes.c_uint32, ctypes.c_bool], None),
        "get": _cxx_function("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                             [c_ctx, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
        "ids": _cxx_function("_Z28llama_model_target_layer_idsPK11llama_model",
                             [c_model], ctypes.POINTER(ctypes.c_int32)),
        "n_ids": _cxx_function("_Z30llama_model_target_layer_ids_nPK11llama_model",
                               [c_model], ctypes.c_uint32),
    }
    return None if any(f is None for f in api.values()) else api


class NativeModel:
    """A loaded GGUF: weights and vocabulary."""

    def __init__(self, path: str | os.PathLike[str], n_gpu_layers: int = 0,
                 vocab_only: bool = False, repack: bool = True, load_mtp: bool = False,
                 devices: ctypes.Array[ctypes.c_void_p] | None = None,
                 overrides: ctypes.Array | None = None) -> None:
        """Raises ModelLoadError for a missing, non-GGUF, truncated or unsupported file.
        ``vocab_only`` reads the header and vocabulary, no weights (fast). ``repack``:
        llama.cpp's CPU "extra" buffers (weights repacked for SIMD; for some types a
        batch of 4+ rows then sums in another order than one row). ``load_mtp``: load
        the file's next-token (MTP) blocks too, which only an MTP context runs.
        ``devices``: the NULL-terminated devices offloaded layers go to (workers' RPC
        devices, engine.runtime.native_rpc), instead of llama.cpp's default GPUs;
        ``overrides``: tensors pinned to a buffer type (native_rpc.cpu_overrides)."""
        self.path = Path(path)
        check_gguf_magic(self.path)
        ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        params.use_extra_bufts = repack
        params.load_mtp = load_mtp
        if devices is not None:
            params.devices = ctypes.cast(devices, ctypes.c_void_p).value
        if overrides is not None:
            params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p).value
        self.repack = repack
        mark = _log_mark()
        handle = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not handle:
            why = (why_unloadable(self.path) or _native_errors_since(mark)
                   or "llama.cpp could not load it")
            raise ModelLoadError(f"cannot load {self.path}: {why}")
        self._handle = handle
        self._vocab = llama_cpp.llama_model_get_vocab(handle)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_embd = int(llama_cpp.llama_model_n_embd(handle))
        self.n_layer = int(llama_cpp.llama_model_n_layer(handle))  # the trunk's
        self.n_layer_nextn = int(llama_cpp.llama_model_n_layer_nextn(handle))
        # Whether those blocks' weights are loaded: an MTP context over a model loaded
        # without them passes llama.cpp's checks, then aborts on its first decode.
        self.mtp_loaded = load_mtp and self.n_layer_nextn > 0 and not vocab_only
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(handle))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.bos_id = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eog_ids = frozenset(
            t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)
        )
        self._pieces: list[bytes] | None = None

    @property
    def handle(self) -> llama_cpp.llama_model_p:
        if self._handle is None:
            raise ClosedError("model")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            llama_cpp.llama_model_free(self._handle)
            self._handle = None

    def __enter__(self) -> NativeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def n_head_kv(self) -> int:
        """KV heads (of layer 0); llama.cpp aborts on this for a vocab-only load."""
        return int(llama_cpp.llama_model_n_head_kv(self.handle))

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): llama.cpp keeps V
        as a view of K in the cache, so both must be one type."""
        arch = self.metadata("general.architecture") or ""
        return self.metadata(f"{arch}.attention.key_length_mla") is not None

    def architecture(self) -> ArchitectureFacts:
        """The architecture's memory layout (sliding window, recurrent, hybrid)."""
        handle = self.handle
        return ArchitectureFacts(name=self.metadata("general.architecture") or "unknown",
                                 n_swa=max(0, int(llama_cpp.llama_model_n_swa(handle))),
                                 recurrent=bool(llama_cpp.llama_model_is_recurrent(handle)),
                                 hybrid=bool(llama_cpp.llama_model_is_hybrid(handle)))

    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers an EAGLE-3 head reads (empty for any other model)."""
        api = _layer_input_api()
        if api is None:
            return ()
        n = int(api["n_ids"](self.handle))  # type: ignore[operator]
        ptr = api["ids"](self.handle)  # type: ignore[operator]
        return tuple(int(ptr[i]) for i in range(n)) if n and ptr else ()

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        # Returns the length of the value, or -1 when the key is absent.
        n = llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self.handle, None)
        return raw.decode("utf-8") if raw else None

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        self.handle  # noqa: B018 - raises ClosedError: the vocab dies with the model
        data = utf8_bytes(text)
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        # Returns the count, or minus the count needed when the buffer is too small.
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special,
                                     parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special,
                                         parse_special)
        if n < 0:
            raise NativeError("llama_tokenize", n)
        return list(buf[:n])

    def pieces(self) -> list[bytes]:
        """The bytes each token id renders to (special tokens rendered), cached."""
        if self._pieces is None:
            self.handle  # noqa: B018 - raises ClosedError: the vocab dies with the model
            buf = ctypes.create_string_buffer(256)
            out = []
            for t in range(self.n_vocab):
                n = llama_cpp.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, True)
                out.append(buf.raw[: max(n, 0)])
            self._pieces = out
        return self._pieces

    def vocab_facts(self) -> VocabFacts:
        """What llama.cpp's draft compatibility rules compare (a vocab-only load is enough)."""
        vocab = self._vocab
        self.handle  # noqa: B018 - raises ClosedError: the vocab dies with the model
        kind = int(llama_cpp.llama_vocab_type(vocab))
        texts = tuple((llama_cpp.llama_vocab_get_text(vocab, t) or b"")
                      for t in range(self.n_vocab))
        return VocabFacts(name=self.path.name, vocab_type=VOCAB_TYPES.get(kind, str(kind)),
                          add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
                          bos_id=int(llama_cpp.llama_vocab_bos(vocab)),
                          add_eos=bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
                          eos_id=int(llama_cpp.llama_vocab_eos(vocab)), texts=texts)


class NativeGrammar:
    """One parse state of a GBNF grammar over a model's vocabulary: llama.cpp's grammar
    sampler (engine.decoding.grammar builds constrained decoding on it)."""

    CANDIDATE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data

    def __init__(self, sampler: object) -> None:
        self._sampler = sampler

    @classmethod
    def compile(cls, model: NativeModel, gbnf: str, root: str = "root") -> NativeGrammar | None:
        """The grammar's start state; None when llama.cpp cannot parse it."""
        sampler = llama_cpp.llama_sampler_init_grammar(model._vocab, gbnf.encode("utf-8"),
                                                       root.encode("utf-8"))
        return cls(sampler) if sampler else None

    def clone(self) -> NativeGrammar:
        return NativeGrammar(llama_cpp.llama_sampler_clone(self._sampler))

    def close(self) -> None:
        if self._sampler is not None:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def apply(self, candidates: np.ndarray) -> None:
        """Set the logit of every candidate (a CANDIDATE array) the grammar forbids next to
        -inf, in place."""
        array = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=len(candidates), selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))

    def accept(self, token: int) -> None:
        """Advance past ``token``; llama.cpp aborts the process on one it forbids, so the
        caller checks first."""
        llama_cpp.llama_sampler_accept(self._sampler, token)


def json_schema_gbnf(schema: str) -> str:
    """GBNF for JSON values matching ``schema`` (JSON text), by llama-cpp-python's
    converter (pure Python; it lives in the package this module wraps). Raises what the
    converter raises on a schema it cannot take."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(schema)


def json_object_gbnf() -> str:
    """GBNF for any JSON object (llama-cpp-python's ``JSON_GBNF``)."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def control_tokens(model: NativeModel) -> np.ndarray:
    """bool [n_vocab]: the vocabulary's control tokens (chat markup, ends of turns)."""
    flag = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    return np.array([bool(llama_cpp.llama_vocab_get_attr(model._vocab, t) & flag)
                     for t in range(model.n_vocab)], dtype=bool)


class NativeBatch:
    """A reusable ``llama_batch`` of up to ``n_tokens_max`` tokens."""

    def __init__(self, n_tokens_max: int, n_seq_max: int) -> None:
        self.n_tokens_max = n_tokens_max
        self.n_seq_max = n_seq_max
        self._batch = llama_cpp.llama_batch_init(n_tokens_max, 0, n_seq_max)
        self._open = True

    @property
    def raw(self) -> llama_cpp.llama_batch:
        if not self._open:
            raise ClosedError("batch")
        return self._batch

    def fill(
        self,
        tokens: list[int],
        positions: list[int],
        seq_ids: list[tuple[int, ...]] | None,
        outputs: list[bool] | bool,
    ) -> None:
        """Fill the batch. ``seq_ids`` None puts every token in sequence 0."""
        n = len(tokens)
        if n > self.n_tokens_max:
            raise ValueError(f"batch of {n} tokens exceeds its capacity {self.n_tokens_max}")
        b = self.raw
        tok, pos, nsq, sq, lg = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        for i in range(n):
            tok[i] = tokens[i]
            pos[i] = positions[i]
            if seq_ids is None:
                nsq[i] = 1
                sq[i][0] = 0
            else:
                ids = seq_ids[i]
                nsq[i] = len(ids)
                row = sq[i]
                for j, s in enumerate(ids):
                    row[j] = s
            lg[i] = outputs if isinstance(outputs, bool) else outputs[i]
        b.n_tokens = n

    def fill_one(self, token: int, position: int) -> None:
        """The plain-decoding fast path: one token of sequence 0, with its output."""
        b = self.raw
        b.token[0] = token
        b.pos[0] = position
        b.n_seq_id[0] = 1
        b.seq_id[0][0] = 0
        b.logits[0] = 1
        b.n_tokens = 1

    def close(self) -> None:
        if self._open:
            llama_cpp.llama_batch_free(self._batch)
            self._open = False

    def __enter__(self) -> NativeBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _embd(vector: np.ndarray) -> tuple[llama_cpp.llama_embd, np.ndarray]:
    """One row as llama.cpp's ``llama_embd``, with the float32 array it points into: the
    caller keeps that array alive until llama.cpp has copied the row (when it is added)."""
    row = np.ascontiguousarray(vector, dtype=np.float32)
    return (llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1,
                                 row.shape[-1]), row)


class NativeExtBatch:
    """A reusable extended batch (``llama_batch_ext``) of one context: rows that carry a
    vector, alone (an encoder's input) or beside a token (an eagle3 head's decoder)."""

    def __init__(self, ctx: NativeContext) -> None:
        self._batch = llama_cpp.llama_batch_ext_init(ctx.handle)
        if not self._batch:
            raise ModelLoadError("cannot make an extended batch")
        self.n_rows = 0

    @property
    def raw(self) -> ctypes.c_void_p:
        if not self._batch:
            raise ClosedError("batch")
        return self._batch

    def clear(self) -> None:
        llama_cpp.llama_batch_ext_clear(self.raw)
        self.n_rows = 0

    def add_vector(self, row: np.ndarray, position: int, seq_id: int = 0,
                   output: bool = True) -> None:
        """A row that is a vector alone."""
        embd, _kept = _embd(row)
        self._added(llama_cpp.llama_batch_ext_add_embd(self.raw, seq_id, embd), position,
                    output)

    def add_token(self, token: int, vector: np.ndarray, position: int, seq_id: int = 0,
                  output: bool = False) -> None:
        """A row that is a token with a vector beside it."""
        i = llama_cpp.llama_batch_ext_add_token(self.raw, seq_id, token)
        embd, _kept = _embd(vector)
        if i >= 0 and not llama_cpp.llama_batch_ext_set_embd_token(self.raw, i, embd):
            i = -2
        self._added(i, position, output)

    def _added(self, i: int, position: int, output: bool) -> None:
        if i < 0:
            raise NativeError("llama_batch_ext_add", i, {-1: "the batch is full",
                                                         -2: "invalid token or vector",
                                                         -3: "invalid sequence"}.get(i, ""))
        pos = llama_cpp.llama_pos(position)
        llama_cpp.llama_batch_ext_set_pos(self.raw, i, ctypes.byref(pos))
        llama_cpp.llama_batch_ext_set_output_logits(self.raw, i, output)
        self.n_rows += 1

    def close(self) -> None:
        if self._batch:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None

    def __enter__(self) -> NativeExtBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NativeContext:
    """A llama.cpp context: the KV cache and the compute graph for one model."""

    def __init__(
        self,
        model: NativeModel,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int,
        n_threads: int,
        features: bool,
        type_k: str = "q8_0",
        type_v: str = "f16",
        unified_kv: bool = True,
        flash_attn: bool = True,
        n_rs_seq: int = 0,
        op_offload: bool = True,
        feature_layers: tuple[int, ...] = (),
        ctx_other: NativeContext | None = None,
        mtp: bool = False,
    ) -> None:
        """Raises ModelLoadError when llama.cpp cannot create the context (memory).
        ``n_rs_seq``: recurrent-state snapshots kept per sequence, so that many tokens can
        be taken back after a decode (architectures that support it). ``op_offload``:
        in a build that can offload, llama.cpp runs a batch of 32+ tokens on the GPU even
        for weights kept on the CPU (fast prefill), so such a batch sums in another order
        than one token on the CPU (an H200: the probe's 33-token chain differed at every
        position, shorter ones were exact); off, every batch stays on the CPU.
        ``feature_layers``: with features on, ``features`` gives these layers'
        inputs side by side (an EAGLE-3 head's features) instead of the last layer's
        output. ``ctx_other``: the target context an eagle3 head borrows its token
        embedding and LM head from (it must outlive this one). ``mtp``: a context that
        runs the model's next-token block instead of its trunk (the model must be loaded
        with ``load_mtp``; its KV holds that block's layer only)."""
        ensure_backend()
        if mtp and not model.mtp_loaded:
            # llama.cpp would make the context, then abort on its first decode.
            why = ("it has no next-token (MTP) blocks" if not model.n_layer_nextn
                   else "its next-token blocks were not loaded")
            raise ModelLoadError(f"cannot run {model.path.name}'s MTP block: {why}")
        self.model = model
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.embeddings = features
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        # Tree verification puts one token in several sequences: needs one shared KV buffer.
        # (Independent sequences, as in batched data generation, are cheaper in separate
        # streams: attention then skips the other sequences' cells.)
        params.kv_unified = unified_kv
        # With K and V of one float type, llama.cpp's CPU flash attention takes a
        # split-KV path for single-token decodes once the cache holds >= 512 cells, and
        # a batch is then computed differently from the same tokens one by one (logits
        # off by ~0.5): greedy speculative output would drift from plain decoding.
        # K in Q8_0, V in F16 keeps every batch size on one kernel (bit-identical
        # logits here) at about F16's decode speed; Q8_0 V would cost more
        # (docs/benchmarks.md: figures behind the code's rules, "The KV cache's types").
        # Without flash attention (llama-server's "auto" turns it on here too) one token
        # over a long cache is faster through the matrix kernels (a 1.7B-shaped Q4_K_M
        # after 768 tokens: llama-bench 60.8 tok/s off, 52.6 on) and the probe's chains
        # are exact, but a drafted session then parted from plain decoding (the F32 case
        # in tests/cases: 0.149), likely because softmax and V sum over the cells in SIMD
        # lanes, where a parked cell's hole shifts every later cell's lane. Targets keep
        # it on (TargetConfig.flash_attn).
        if model.latent_attention:
            # Its V is a view of K: llama.cpp refuses two types. Q8_0 for both keeps the
            # exact mode's one kernel for every batch size (the probe checks it).
            type_v = type_k
        # llama.cpp quantizes V only with flash attention.
        self.flash_attn = flash_attn or type_v not in ("f16", "f32", "bf16")
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.n_rs_seq = n_rs_seq
        params.op_offload = op_offload
        self.op_offload = op_offload
        params.type_k = _KV_TYPES[type_k]
        params.type_v = _KV_TYPES[type_v]
        # llama.cpp's K shift of a latent-attention cache in a quantized type crashes
        # (deepseek2 Q8_0 K, the differential's long chats; F16 shifts): no shift then.
        self._shift_crashes = model.latent_attention and type_k not in ("f16", "f32", "bf16")
        if ctx_other is not None:
            params.ctx_other = ctx_other.handle
        if mtp:
            params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        mark = _log_mark()
        handle = llama_cpp.llama_init_from_model(model.handle, params)
        if not handle:
            why = _native_errors_since(mark) or "out of memory?"
            raise ModelLoadError(f"cannot create a {n_ctx}-token context: {why}")
        self._handle = handle
        self._memory = llama_cpp.llama_get_memory(handle)
        self.last_batch_start = 0
        # Recurrent state (an MTP context's memory is one plain KV layer even on a hybrid).
        self._stateful = not mtp and model.architecture().has_state
        self.n_ctx = int(llama_cpp.llama_n_ctx(handle))
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd
        self._features = features
        self._llama_embeddings = features  # llama.cpp's own flag (embeddings mode), as last set
        self.feature_layers: tuple[int, ...] = ()
        self.next_features = False  # features are the trunk's output for an MTP block
        self._llama_nextn = False  # llama.cpp's next-token rows flag, as last set
        try:
            self.set_feature_layers(feature_layers)
        except BaseException:
            self.close()
            raise
        # The last logits row's view, by the address llama.cpp gave: plain decoding reads
        # one row every step, and numpy's ctypes route rebuilt an array type each time
        # (docs/benchmarks.md: figures behind the code's rules, "Per-step costs").
        self._row_view: tuple[int, np.ndarray] = (0, np.empty(0, np.float32))

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Which layers' inputs ``features`` gives (none: the last layer's output).
        Raises ModelLoadError for a layer the model lacks or a build that cannot."""
        layers = tuple(layers)
        if layers == self.feature_layers:
            return
        api = _layer_input_api()
        bad = [i for i in layers if not 0 <= i < self.model.n_layer]
        arch = self.model.architecture()
        if layers and (api is None or bad or not arch.layer_inputs):
            # Graphs that cannot export a layer's input abort the process if asked.
            why = (f"layers {bad} are not among its {self.model.n_layer}" if bad else
                   "this llama.cpp build cannot export layer inputs" if api is None else
                   f"llama.cpp's {arch.name} graph cannot export layer inputs")
            raise ModelLoadError(f"cannot read EAGLE-3 features of {self.model.path.name}: "
                                 f"{why}")
        if api is not None:
            for layer in self.feature_layers:
                api["set"](self.handle, layer, False)  # type: ignore[operator]
            for layer in layers:
                api["set"](self.handle, layer, True)  # type: ignore[operator]
        self.feature_layers = layers
        self._sync_features()

    def set_next_features(self, on: bool) -> None:
        """``features`` gives what an MTP block reads, the trunk's normed output of
        every token in a batch (llama.cpp's unmasked next-token rows), with llama.cpp's
        embeddings mode off: those rows come with every decode where features are on."""
        if on and self.feature_layers:
            raise ValueError("features are layer inputs already")
        if on != self.next_features:
            self.next_features = on
            self._sync_features()

    @property
    def feature_width(self) -> int:
        """Floats per token in ``features``."""
        return self.n_embd * max(1, len(self.feature_layers))

    @property
    def handle(self) -> llama_cpp.llama_context_p:
        if self._handle is None:
            raise ClosedError("context")
        return self._handle

    @property
    def memory(self) -> llama_cpp.llama_memory_t:
        if self._handle is None:
            raise ClosedError("context")
        return self._memory

    def close(self) -> None:
        if self._handle is not None:
            llama_cpp.llama_free(self._handle)
            self._handle = None
            self._memory = None  # freed with the context

    def __enter__(self) -> NativeContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_n_threads(self, n_threads: int) -> None:
        """Decode with ``n_threads`` threads from the next decode on (one-token decodes
        and batches alike)."""
        llama_cpp.llama_set_n_threads(self.handle, n_threads, n_threads)

    def set_features(self, on: bool) -> None:
        """Output hidden states too; the caller then makes every token an output.
        With ``feature_layers`` llama.cpp's embeddings mode stays off: layer inputs come
        with every decode, and some graphs (LFM2) compute no logits in that mode."""
        self._features = on
        self._sync_features()

    def _sync_features(self) -> None:
        # Next-token rows only while features are on: they unmask every row of the last
        # layer, whose sums for the last token then differ from a prompt read without
        # them (deepseek2 F32 with prompt kernels: 7e-7, the differential).
        nextn = self._features and self.next_features
        if nextn != self._llama_nextn:
            from llama_cpp import llama_cpp_ext

            llama_cpp_ext.llama_set_embeddings_nextn(self.handle, nextn, False)
            self._llama_nextn = nextn
        wanted = self._features and not self.feature_layers and not self.next_features
        if wanted != self._llama_embeddings:
            llama_cpp.llama_set_embeddings(self.handle, wanted)
            self._llama_embeddings = wanted

    @property
    def features_on(self) -> bool:
        return self._features

    def decode(self, batch: NativeBatch) -> None:
        """Run the batch. Raises ContextFullError (KV full) or NativeError."""
        # Where it starts: recurrent state can be taken back only within the last batch.
        self.last_batch_start = int(batch.raw.pos[0]) if batch.raw.n_tokens else 0
        with _PROMPT_KERNELS_HELD:
            rc = llama_cpp.llama_decode(self.handle, batch.raw)
        self._check("llama_decode", rc, batch.raw.n_tokens, "batch")

    def _check(self, call: str, rc: int, n_tokens: int, what: str) -> None:
        """llama_decode's and llama_process's return codes as errors."""
        if rc == 1:
            raise ContextFullError(n_tokens, self.n_ctx, what=what)
        if rc != 0:
            raise NativeError(call, rc, _DECODE_MEANINGS.get(rc, ""))

    def logits_view(self, n_outputs: int) -> np.ndarray:
        """No-copy view of the last decode's logits, [n_outputs, n_vocab]; valid until the
        next decode (a verification's rows are read before it: at a 262k vocabulary a
        17-row copy was 17.8 MB a step)."""
        ptr = llama_cpp.llama_get_logits(self.handle)
        return np.ctypeslib.as_array(ptr, shape=(n_outputs, self.n_vocab))

    def logits(self, n_outputs: int) -> np.ndarray:
        """Copy of the logits of the last decode's outputs, shape [n_outputs, n_vocab]."""
        return self.logits_view(n_outputs).copy()

    def argmax_logits(self, n_outputs: int) -> list[int]:
        """The highest-scoring token of each output of the last decode (no copy)."""
        return self.logits_view(n_outputs).argmax(-1).tolist()

    def last_logits_view(self, n_outputs: int) -> np.ndarray:
        """No-copy view of the last output's logits; valid until the next decode."""
        address = _logits_row_address()(self.handle, n_outputs - 1)
        if not address:
            raise NativeError("llama_get_logits_ith", n_outputs - 1, "no logits for that output")
        if address != self._row_view[0]:
            row = (ctypes.c_float * self.n_vocab).from_address(address)
            self._row_view = (address, np.frombuffer(row, dtype=np.float32))
        return self._row_view[1]

    def features(self, n_outputs: int) -> np.ndarray:
        """Copy of the post-norm hidden states of the last decode, [n_outputs, n_embd];
        with ``feature_layers``, those layers' inputs, [n_outputs, n_layers * n_embd]
        (every token of the batch, which callers in features mode make outputs)."""
        if not self._features:
            raise RuntimeError("features need the context made or set with features on")
        if self.next_features:
            return self.next_vectors(n_outputs)
        if not self.feature_layers:
            ptr = llama_cpp.llama_get_embeddings(self.handle)
            return np.ctypeslib.as_array(ptr, shape=(n_outputs, self.n_embd)).copy()
        api = _layer_input_api()
        assert api is not None  # checked when the context was made
        out = np.empty((n_outputs, self.feature_width), np.float32)
        for k, layer in enumerate(self.feature_layers):
            ptr = api["get"](self.handle, layer)  # type: ignore[operator]
            rows = np.ctypeslib.as_array(ptr, shape=(n_outputs, self.n_embd))
            out[:, k * self.n_embd:(k + 1) * self.n_embd] = rows
        return out

    # --- a draft head's context (eagle3: encode features, decode token + vector) -----------
    def next_vectors(self, n_rows: int) -> np.ndarray:
        """Copy of the last process's "nextn" rows, [n_rows, n_embd]: an eagle3 head's
        fused features after an encode, its pre-norm outputs after a decode (outputs
        only). Needs ``enable_next_vectors``."""
        from llama_cpp import llama_cpp_ext

        ptr = llama_cpp_ext.llama_get_embeddings_nextn(self.handle)
        if not ptr:
            raise NativeError("llama_get_embeddings_nextn", 0, "no rows")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd)).copy()

    def enable_next_vectors(self) -> None:
        from llama_cpp import llama_cpp_ext

        llama_cpp_ext.llama_set_embeddings_nextn(self.handle, True, True)

    def process(self, batch: NativeExtBatch, encode: bool) -> None:
        """Run an extended batch: an encoder pass (rows of features) or a decoder pass.
        Raises ContextFullError or NativeError as ``decode`` does."""
        kind = (llama_cpp.LLAMA_PROCESS_TYPE_ENCODE if encode
                else llama_cpp.LLAMA_PROCESS_TYPE_DECODE)
        with _PROMPT_KERNELS_HELD:  # (as ``decode``: never inside another's prompt kernels)
            rc = llama_cpp.llama_process(self.handle, kind, batch.raw)
        self._check("llama_process", rc, batch.n_rows, "head batch")

    # KV cache. Positions: p0 inclusive, p1 exclusive, negative means open-ended.
    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        """False when the memory cannot drop that range: recurrent state past its
        snapshots (nothing was removed then). Snapshots are the states after each token
        of the last batch: llama.cpp's seq_rm says true further back too, with the state
        wrong (a new prompt parting 3-8 tokens before the cache's end gave other logits
        than a fresh prefill, max diff 6), so that is refused here."""
        if self._stateful and 0 < p0 <= self.last_batch_start:
            return False
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def kv_copy(self, seq_src: int, seq_dst: int, p0: int = -1, p1: int = -1) -> None:
        llama_cpp.llama_memory_seq_cp(self.memory, seq_src, seq_dst, p0, p1)

    def kv_clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def kv_shift(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Add ``delta`` to the positions in [p0, p1) of the sequence. K is rotated to
        the new positions at the next decode (a RoPE of the difference; on a quantized K
        through F32 and back, so its numbers change)."""
        llama_cpp.llama_memory_seq_add(self.memory, seq_id, p0, p1, delta)

    @property
    def can_shift(self) -> bool:
        """Whether the memory can shift positions (not recurrent state, not M-RoPE, not
        a latent-attention cache of a quantized K)."""
        return not self._shift_crashes and bool(llama_cpp.llama_memory_can_shift(self.memory))

    def state_seq_get(self, seq_id: int) -> bytes:
        """llama.cpp's serialized cells of one sequence (engine.runtime.kv_transfer reads it)."""
        return self.state_seq_array(seq_id).tobytes()

    def state_seq_array(self, seq_id: int, into: np.ndarray | None = None,
                        partial: bool = False) -> np.ndarray:
        """``state_seq_get`` as a uint8 array, with no copy. A fresh ``bytes`` (or a ctypes
        array) of a long prompt's cells is touched page by page; numpy's large arrays get
        huge pages, much sooner (docs/benchmarks.md: figures behind the code's rules,
        "Moving a prompt's cells"). ``into``: a uint8 array to write it in when it is
        big enough (the result is a view of it). ``partial``: only the recurrent state
        (or the window cache), not the attention cells (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)."""
        mark = _log_mark()
        flags = PARTIAL_STATE if partial else 0
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.handle, seq_id, flags))
        buffer = into if into is not None and into.size >= size and into.dtype == np.uint8 \
            else np.empty(size, dtype=np.uint8)
        written = int(llama_cpp.llama_state_seq_get_data_ext(
            self.handle, buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq_id,
            flags))
        if not written:
            raise NativeError("llama_state_seq_get_data", 0, _native_errors_since(mark))
        return buffer[:written]

    def state_seq_set(self, seq_id: int, blob: bytes | np.ndarray,
                      partial_at: int | None = None) -> None:
        """Replace the sequence's cells with a blob from ``state_seq_get`` (of a cache of
        the same types); on failure llama.cpp leaves the sequence empty. ``partial_at``:
        a blob of the recurrent state alone (``state_seq_array(partial=True)``) as it
        stood after that many tokens; the attention cells are left as they are (those
        after it are the caller's to remove)."""
        mark = _log_mark()
        data = np.frombuffer(blob, dtype=np.uint8)  # read in place, no copy
        buffer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        flags = 0 if partial_at is None else PARTIAL_STATE
        if not llama_cpp.llama_state_seq_set_data_ext(self.handle, buffer, len(blob), seq_id,
                                                      flags):
            raise NativeError("llama_state_seq_set_data", 0, _native_errors_since(mark))
        if self._stateful:
            # Restored state comes without snapshots (llama.cpp resets their index): no
            # token of it can be taken back until a decode writes new ones; cells after
            # a partial state's last token can go (the state is not theirs).
            self.last_batch_start = 2**31 - 1 if partial_at is None else partial_at - 1

    def kv_pos_max(self, seq_id: int) -> int:
        """Largest position held by the sequence, -1 when it is empty."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id))

    def kv_pos_min(self, seq_id: int) -> int:
        """Smallest position held by the sequence, -1 when it is empty. For a
        sliding-window model, the window cache's: llama.cpp reuses cells that have left
        the window for new tokens (and then drops every earlier position of theirs)."""
        return int(llama_cpp.llama_memory_seq_pos_min(self.memory, seq_id))



def quantize(src: Path, dst: Path, ftype: int, n_threads: int,
             importance: Mapping[str, np.ndarray] | None = None,
             vocab_type: int | None = None) -> None:
    """Requantize a GGUF with llama.cpp (``allow_requantize``). ``importance``: tensor
    name -> one float per input column (times experts), the importance matrix the
    IQ1/IQ2/IQ3_XXS types cannot be made without. ``vocab_type``: a ggml type for the
    token embedding and output matrices instead of the file type's choice. Raises
    NativeError."""
    ensure_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    params.allow_requantize = True
    if vocab_type is not None:
        params.token_embedding_type = params.output_tensor_type = vocab_type
    keep: list[object] = []  # the arrays llama.cpp reads must outlive the call
    if importance:
        entries = (llama_cpp.llama_model_imatrix_data * (len(importance) + 1))()
        for i, (name, values) in enumerate(importance.items()):
            entry = entries[i]  # a view into the array, not a copy
            column = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(column)
            entry.name = name.encode()
            entry.data = column.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = column.size
        params.imatrix = entries  # the last entry's null name ends the list
        keep.append(entries)
    mark = _log_mark()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise NativeError("llama_model_quantize", rc, _native_errors_since(mark))


# llama.cpp's file types for quantize, by the name Tandem's commands use.
FTYPES = {
    "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
}


def ftype_named(name: str) -> int:
    """llama.cpp's file type for any type its quantize makes, by name: ``f32``, ``q4_k_m``,
    ``iq4_nl``, ``mxfp4_moe``... (IQ1/IQ2 and IQ3_XXS also need an importance matrix:
    engine.hub.convert.quantize_as gives one). Raises ValueError naming the known ones."""
    key = name.strip().upper()
    for prefix in ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_"):
        value = getattr(llama_cpp, prefix + key, None)
        if isinstance(value, int):
            return value
    known = sorted(n.split("_", 3)[-1].lower() for n in dir(llama_cpp)
                   if n.startswith(("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")))
    raise ValueError(f"unknown weight type {name!r}; llama.cpp makes {', '.join(known)}")
FTYPE_Q4_0 = FTYPES["q4_0"]


def kernel_settings(repack: bool) -> dict[str, object]:
    """The CPU kernel switches a model runs with, as the plan shows them: weight
    repacking (per model load), the tiled K-quant matmul and op fusion (per process,
    from the environment), and llamafile's sgemm (the build). Where the build has
    Tandem's switch (see the Makefile), the first two are on for prompts only."""
    tiled = os.environ.get("GGML_CPU_TILED_MM", "1").strip() not in ("0", "")
    fusion = os.environ.get("GGML_CPU_DISABLE_FUSION", "0")
    prompts: object = "prompts" if prompt_kernels_available() else False
    lib = ggml_cpu_library()
    sgemm = lib is not None and bool(getattr(lib, "ggml_cpu_has_llamafile", lambda: 0)())
    return {"repack": repack, "tiled_matmul": tiled or prompts,
            "fusion": fusion.strip() in ("0", ""), "llamafile_sgemm": sgemm and prompts}


def llama_version() -> str:
    """The llama-cpp-python release (its vendored llama.cpp), for cache keys."""
    return str(getattr(llama_cpp, "__version__", "unknown"))
