"""The CPU library's attention kernel gives a query row the same bits whatever shares its
batch (packaging/llama-cpp/tiled-attention.patch).

This builds ggml's own flash-attention op through its C API on a random cache (a Q8_0 or
F16 K, an F16 V, three query heads per KV head, causal masks as llama.cpp writes them) and
computes the same rows in batches of 1, 2, 3, 5, 8, 16, 31 and 64 tokens, with 1-4 threads,
over a cache cut right after the batch or padded to 256 cells as llama.cpp pads it. Every
row must equal, as bits, the row computed alone; and it must be close to attention worked
out in float64 from the same (dequantized) K and V (ggml's own one-row path is ~1e3 times
further off: it sums V in F16).

A self-check of the build, as engine.runtime.repack_check is: tests/test_attention_kernel.py
runs it on the library this process loaded, ``tandem check-cpu`` on every CPU level of a
portable build.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import numpy as np

from engine.runtime.cpu_variants import mapped_library
from engine.runtime.llama_bindings import ggml_cpu_library, lib_dir

GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 = 0, 1, 8
BATCHES = (1, 2, 3, 5, 8, 16, 31, 64)
THREADS = (1, 2, 3, 4)
HEAD_DIM = 64
N_HEAD, N_HEAD_KV = 6, 2
GROUP = N_HEAD // N_HEAD_KV  # query heads sharing a KV head, as in SmolLM2 (3)
# Rows start past the first 512-cell chunk, so every row merges chunks.
FIRST_POS = 1000
PAD = 256
CLOSE = 1e-4  # from float64 attention; measured ~2e-6


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class _Ggml:
    """The few ggml calls a graph of one flash-attention op needs."""

    def __init__(self, base: ctypes.CDLL, cpu: ctypes.CDLL) -> None:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self.init = base.ggml_init
        self.init.argtypes, self.init.restype = [_InitParams], vp
        self.free = base.ggml_free
        self.free.argtypes, self.free.restype = [vp], None
        self.tensor = base.ggml_new_tensor_4d
        self.tensor.argtypes, self.tensor.restype = [vp, ctypes.c_int, i64, i64, i64, i64], vp
        self.attn = base.ggml_flash_attn_ext
        self.attn.argtypes = [vp, vp, vp, vp, vp, ctypes.c_float, ctypes.c_float,
                              ctypes.c_float]
        self.attn.restype = vp
        self.data = base.ggml_get_data
        self.data.argtypes, self.data.restype = [vp], vp
        self.graph = base.ggml_new_graph
        self.graph.argtypes, self.graph.restype = [vp], vp
        self.expand = base.ggml_build_forward_expand
        self.expand.argtypes, self.expand.restype = [vp, vp], None
        self.compute = cpu.ggml_graph_compute_with_ctx
        self.compute.argtypes, self.compute.restype = [vp, vp, ctypes.c_int], ctypes.c_int
        self.quantize_q8_0 = cpu.quantize_row_q8_0
        self.quantize_q8_0.argtypes = [vp, vp, i64]
        self.switch = getattr(cpu, "ggml_cpu_set_batch_invariant_attention", None)
        if self.switch is not None:
            self.switch.argtypes, self.switch.restype = [ctypes.c_bool], None
            self.is_on = cpu.ggml_cpu_get_batch_invariant_attention
            self.is_on.argtypes, self.is_on.restype = [], ctypes.c_bool

    def put(self, tensor: int, array: np.ndarray) -> None:
        ctypes.memmove(self.data(tensor), array.ctypes.data, array.nbytes)


@dataclass
class _Cache:
    k: np.ndarray  # bytes of K as stored (Q8_0 or F16), [n_kv, N_HEAD_KV, row]
    v: np.ndarray  # F16 [n_kv, N_HEAD_KV, HEAD_DIM]
    q: np.ndarray  # F32 [n_tokens, N_HEAD, HEAD_DIM], the query of the token at each position
    k_type: int


@functools.cache
def _ggml() -> _Ggml | None:
    cpu = ggml_cpu_library()
    if cpu is None:
        return None
    base = mapped_library("ggml-base", variants=False)
    if base is None:
        for name in ("libggml-base.so.0", "libggml-base.so", "libggml-base.dylib"):
            try:
                base = ctypes.CDLL(str(lib_dir() / name))
                break
            except OSError:
                continue
    return _Ggml(base, cpu) if base is not None else None


def kernel_available() -> bool:
    g = _ggml()
    return g is not None and g.switch is not None


def _make_cache(g: _Ggml, k_type: int, n_kv: int, seed: int) -> _Cache:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_kv, N_HEAD_KV, HEAD_DIM), dtype=np.float32)
    if k_type == GGML_TYPE_Q8_0:
        k_bytes = np.empty((n_kv, N_HEAD_KV, HEAD_DIM // 32 * 34), dtype=np.uint8)
        g.quantize_q8_0(k.ctypes.data, k_bytes.ctypes.data, k.size)
    else:
        k_bytes = k.astype(np.float16).view(np.uint8).reshape(n_kv, N_HEAD_KV, -1)
    v = rng.standard_normal((n_kv, N_HEAD_KV, HEAD_DIM), dtype=np.float32).astype(np.float16)
    # Queries scaled so that softmax is peaked as in a model, not flat.
    q = 3.0 * rng.standard_normal((n_kv, N_HEAD, HEAD_DIM), dtype=np.float32)
    return _Cache(k_bytes, v, q, k_type)


def attend(g: _Ggml, cache: _Cache, first: int, n_tokens: int, n_kv: int,
           n_threads: int) -> np.ndarray:
    """Tokens at positions first..first+n_tokens-1 attending causally to the first n_kv
    cells (those after a token masked, as llama.cpp masks them): [n_tokens, N_HEAD, D]."""
    mask_rows = -(-n_tokens // 64) * 64
    mem = (cache.k[:n_kv].nbytes + cache.v[:n_kv].nbytes + 4 * n_tokens * N_HEAD * HEAD_DIM * 2
           + 2 * n_kv * mask_rows + (1 << 20))
    ctx = g.init(_InitParams(mem, None, False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        q = g.tensor(ctx, GGML_TYPE_F32, HEAD_DIM, n_tokens, N_HEAD, 1)
        k = g.tensor(ctx, cache.k_type, HEAD_DIM, n_kv, N_HEAD_KV, 1)
        v = g.tensor(ctx, GGML_TYPE_F16, HEAD_DIM, n_kv, N_HEAD_KV, 1)
        mask = g.tensor(ctx, GGML_TYPE_F16, n_kv, mask_rows, 1, 1)
        # ggml's layouts: q [D, tokens, heads], k/v [D, cells, kv heads]
        g.put(q, np.ascontiguousarray(
            cache.q[first:first + n_tokens].transpose(1, 0, 2)))
        g.put(k, np.ascontiguousarray(cache.k[:n_kv].transpose(1, 0, 2)))
        g.put(v, np.ascontiguousarray(cache.v[:n_kv].transpose(1, 0, 2)))
        m = np.full((mask_rows, n_kv), -np.inf, dtype=np.float16)
        for t in range(n_tokens):
            m[t, :first + t + 1] = 0.0
        g.put(mask, m)
        out = g.attn(ctx, q, k, v, mask, 1.0 / np.sqrt(HEAD_DIM), 0.0, 0.0)
        graph = g.graph(ctx)
        g.expand(graph, out)
        if g.compute(ctx, graph, n_threads) != 0:
            raise RuntimeError("ggml_graph_compute failed")
        size = HEAD_DIM * N_HEAD * n_tokens
        result = np.ctypeslib.as_array(ctypes.cast(g.data(out),
                                                   ctypes.POINTER(ctypes.c_float)), (size,))
        return result.reshape(n_tokens, N_HEAD, HEAD_DIM).copy()
    finally:
        g.free(ctx)


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    b = blocks.reshape(-1, 34)
    scale = b[:, :2].copy().view(np.float16).astype(np.float64)
    return (b[:, 2:].view(np.int8).astype(np.float64) * scale).reshape(-1)


def _float64_row(g: _Ggml, cache: _Cache, pos: int) -> np.ndarray:
    """The token at ``pos`` attending to cells 0..pos, in float64 from the values the
    kernel multiplies (K and V as stored, Q in F32)."""
    n = pos + 1
    out = np.empty((N_HEAD, HEAD_DIM))
    for h in range(N_HEAD):
        q64 = cache.q[pos, h].astype(np.float64)
        if cache.k_type == GGML_TYPE_Q8_0:
            k64 = np.stack([_dequantize_q8_0(row) for row in cache.k[:n, h // GROUP]])
        else:
            k64 = cache.k[:n, h // GROUP].copy().view(np.float16).astype(np.float64)
        s = k64 @ q64 / np.sqrt(HEAD_DIM)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ cache.v[:n, h // GROUP].astype(np.float64)
    return out


@dataclass
class AttentionCheck:
    kernel: str  # "attention (q8_0 K)", named as repack_check's KernelCheck is
    status: str = "exact"  # "exact", "differs", "far" (from float64), "not built"
    differing: list[str] = field(default_factory=list)  # "batch 16, 2 threads, padded"
    max_gap: float = 0.0  # largest distance from float64 attention

    @property
    def failed(self) -> bool:
        return self.status in ("differs", "far")


def check_attention(k_type: str = "q8_0", batches: tuple[int, ...] = BATCHES,
                    threads: tuple[int, ...] = THREADS, seed: int = 11,
                    switch_on: bool = True) -> AttentionCheck:
    """Every row of every batch, bit for bit against the row alone (one token, one
    thread, a cache cut after it). ``switch_on=False`` runs ggml's own paths instead, which
    is how a test shows this check can fail."""
    g = _ggml()
    check = AttentionCheck(f"attention ({k_type} K)")
    if g is None or g.switch is None:
        check.status = "not built"
        return check
    type_id = {"q8_0": GGML_TYPE_Q8_0, "f16": GGML_TYPE_F16}[k_type]
    last = FIRST_POS + max(batches)
    cache = _make_cache(g, type_id, -(-last // PAD) * PAD, seed)
    was_on = bool(g.is_on())
    try:
        g.switch(switch_on)
        alone = np.stack([attend(g, cache, FIRST_POS + t, 1, FIRST_POS + t + 1, 1)[0]
                          for t in range(max(batches))])
        for n in batches:
            for n_threads in threads:
                for padded in (False, True):
                    n_kv = FIRST_POS + n
                    n_kv = -(-n_kv // PAD) * PAD if padded else n_kv
                    rows = attend(g, cache, FIRST_POS, n, n_kv, n_threads)
                    if not np.array_equal(rows.view(np.uint32), alone[:n].view(np.uint32)):
                        check.differing.append(f"batch {n}, {n_threads} threads, "
                                               f"{'padded' if padded else 'cut'}")
    finally:
        g.switch(was_on)
    check.max_gap = max(float(np.max(np.abs(alone[t] - _float64_row(g, cache, FIRST_POS + t))))
                        for t in range(0, max(batches), 7))
    if check.differing:
        check.status = "differs"
    elif check.max_gap > CLOSE:
        check.status = "far"
    return check


def check_loaded_attention() -> list[AttentionCheck]:
    """The kernel with the exact mode's Q8_0 K and the fast mode's F16 K."""
    return [check_attention("q8_0"), check_attention("f16")]
