"""Move a sequence's KV cells from an F16 cache into Tandem's Q8_0-K cache.

llama.cpp prefills an F16/F16 cache with faster kernels than a Q8_0 K cache gets (with
flash attention a tiled one; without it the F16 matrix kernels: a 739-token prompt on a
1.7B-shaped Q4_K_M, first token 1.67 s against 2.55 s), so a long prompt's first token
comes later with Q8_0 K (docs/benchmarks.md: figures behind the code's rules, "Reading
prompts"). Decoding needs Q8_0 K (one kernel for every batch size: speculative output
identical to plain decoding). So Tandem prefills in an F16 context and moves the cells: this module
rewrites llama.cpp's sequence-state blob (``llama_state_seq_get_data``), keeping V as it
is and storing K the way llama.cpp stores a quantized K itself: rotated by an orthonormal
Walsh-Hadamard matrix over blocks of the head (llama-kv-cache.cpp, ``attn_rot_k``), then
quantized to Q8_0. Any layout this module does not know raises ``StateFormatError``;
the caller then prefills the slow way.

The blob, for a unified (single-stream) cache and models without per-cell extras (latent
attention, DeepSeek's, writes no V parts: its V is a view of K):
    u32 magic, i32 seq_id, then for each cache:
    u32 n_stream(=1), u32 n_cells,
    n_cells x (i32 pos, u32 n_seq_id(=1), i32 seq_id),
    u32 v_trans, u32 n_layer,
    n_layer x (i32 k_type, u64 k_row_bytes, n_cells rows),
    n_layer x (i32 v_type, u64 v_row_bytes, n_cells rows), or with v_trans (flash
    attention off) n_layer x (i32 v_type, u32 v_size_el, u32 width, width rows of n_cells
    values).
A sliding-window model's cache is two caches (llama-kv-cache-iswa.cpp: the full-attention
layers', then the windowed layers'), written one after the other.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize
from threadpoolctl import ThreadpoolController

from engine.runtime.native import ggml_row_kernels

_F16 = GGMLQuantizationType.F16
_Q8_0 = GGMLQuantizationType.Q8_0
_Q8_BLOCK = GGML_QUANT_SIZES[_Q8_0][0]


class StateFormatError(ValueError):
    """A sequence-state blob this module cannot rewrite."""


@cache
def hadamard(n: int) -> np.ndarray:
    """llama.cpp's orthonormal Sylvester-Walsh-Hadamard matrix of order n (a power of 2)."""
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate_blocks(rows: np.ndarray, block: int, out: np.ndarray | None = None) -> np.ndarray:
    """``rows`` times ``hadamard(block)`` over each block of ``block`` values, as two
    small products: Sylvester's H(a*16) is H(a) (x) H(16), so a block seen as an a x 16
    matrix X becomes H(a) X H(16). A sixth of the multiplications of one block x block
    product, and faster (docs/benchmarks.md: figures behind the code's rules, "Moving a
    prompt's cells"). ``out`` (rows' shape, float32) may be ``rows``."""
    inner = min(block, 16)
    outer = block // inner
    mixed = _scratch("rotate", rows.shape).reshape(-1, inner)
    np.matmul(rows.reshape(-1, inner), hadamard(inner), out=mixed)
    if out is None:
        out = np.empty(rows.shape, dtype=np.float32)
    blocks = out.reshape(-1, outer, inner)
    if outer > 1:
        np.matmul(hadamard(outer), mixed.reshape(-1, outer, inner), out=blocks)
    else:
        blocks[...] = mixed.reshape(blocks.shape)
    return out


_per_thread = threading.local()


def _scratch(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of ``shape`` this thread reuses: a fresh one per layer faulted in
    new pages, which cost more than the layer's rotation (docs/benchmarks.md: figures
    behind the code's rules, "Moving a prompt's cells")."""
    size = int(np.prod(shape))
    buffer = getattr(_per_thread, name, None)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, dtype=np.float32)
        setattr(_per_thread, name, buffer)
    return buffer[:size].reshape(shape)


def rotation_size(head_dim: int) -> int:
    """The block llama.cpp rotates a quantized K over: the largest power of two >= 64
    dividing the head size; 0 when it does not rotate (head size not a multiple of 64)."""
    if head_dim <= 0 or head_dim % 64:
        return 0
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def _f16_to_f32(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    kernels = ggml_row_kernels()
    if kernels:
        return kernels.f16_to_f32(x, out)
    out[...] = x
    return out


def _quantize_q8_0(x: np.ndarray) -> np.ndarray:
    kernels = ggml_row_kernels()
    # gguf's numpy reference writes the same bytes, slower.
    return kernels.quantize_q8_0(x) if kernels else quantize(x, _Q8_0)


class _Reader:
    def __init__(self, blob: bytes | np.ndarray) -> None:
        self.blob = blob
        self.at = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        try:
            values = struct.unpack_from(fmt, self.blob, self.at)
        except struct.error as exc:
            raise StateFormatError(f"state blob ends early ({exc})") from None
        self.at += struct.calcsize(fmt)
        return values

    def rows(self, n_rows: int, row_bytes: int) -> np.ndarray:
        size = n_rows * row_bytes
        if self.at + size > len(self.blob):
            raise StateFormatError("state blob ends inside a tensor")
        out = np.frombuffer(self.blob, dtype=np.uint8, count=size, offset=self.at)
        self.at += size
        return out.reshape(n_rows, row_bytes)


def llama_rotates_quantized_k() -> bool:
    """llama.cpp rotates a quantized K unless LLAMA_ATTN_ROT_DISABLE says otherwise."""
    try:
        return not int(os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0"))
    except ValueError:
        return True  # llama.cpp reads it with atoi: text counts as 0


@cache
def _threadpools() -> ThreadpoolController:
    return ThreadpoolController()


def f16_to_q8_0_keys(blob: bytes | np.ndarray, n_head_kv: int, rotate: bool) -> np.ndarray:
    """``_f16_to_q8_0_keys`` with numpy's BLAS on one thread (its idle threads spin for a
    while after a call and slowed llama.cpp's next decode). A writable array is rewritten
    in place: every part is written at or before where it was read (Q8_0 K is smaller
    than F16 K), and fresh pages for a second array of the same size are not free
    (docs/benchmarks.md: figures behind the code's rules, "Moving a prompt's cells").
    Bytes are written into a new array."""
    in_place = isinstance(blob, np.ndarray) and blob.flags.writeable
    out = _Writer(blob if in_place else np.empty(len(blob), dtype=np.uint8))
    with _threadpools().limit(limits=1, user_api="blas"):
        _f16_to_q8_0_keys(blob, n_head_kv, rotate, out)
    return out.buffer[:out.at]


class _Writer:
    """Appends bytes and arrays to a preallocated uint8 array."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.at = buffer, 0

    def put(self, data: bytes | np.ndarray) -> None:
        raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) \
            else data.reshape(-1).view(np.uint8)
        raw = np.ascontiguousarray(raw)
        if self.at + raw.size > self.buffer.size:
            raise StateFormatError("the rewritten state outgrows its blob")
        # Rewriting in place, raw may be the bytes just ahead: memmove copies them safely.
        ctypes.memmove(self.buffer.ctypes.data + self.at, raw.ctypes.data, raw.size)
        self.at += raw.size


def _f16_to_q8_0_keys(blob: bytes | np.ndarray, n_head_kv: int, rotate: bool,
                      out: _Writer) -> None:
    """Rewrite a sequence-state blob of an F16/F16 cache for a Q8_0-K/F16-V cache.

    ``rotate``: llama.cpp's rotation of quantized K is on (``llama_rotates_quantized_k``);
    it applies to heads whose size is a multiple of 64, a K row being ``n_head_kv``
    heads."""
    read = _Reader(blob)
    out.put(struct.pack("<Ii", *read.take("<Ii")))
    while read.at < len(blob):
        _one_cache(read, n_head_kv, rotate, out)


@cache
def _converter() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(2, thread_name_prefix="kv-move")


def _layer_keys(f16_keys: np.ndarray, n_head_kv: int, rotate: bool) -> np.ndarray:
    """One layer's F16 K rows as llama.cpp stores them quantized: rotated, Q8_0."""
    keys = _f16_to_f32(f16_keys, _scratch("keys", f16_keys.shape))
    width = keys.shape[1]
    if width % _Q8_BLOCK or width % n_head_kv:
        raise StateFormatError(f"K rows of {width} values for {n_head_kv} heads")
    block = rotation_size(width // n_head_kv) if rotate else 0
    return _quantize_q8_0(rotate_blocks(keys, block, out=keys) if block else keys)


def _one_cache(read: _Reader, n_head_kv: int, rotate: bool, out: _Writer) -> None:
    """One cache's part of the blob, K rewritten."""
    n_stream, n_cells = read.take("<II")
    if n_stream != 1:
        raise StateFormatError(f"{n_stream} KV streams (Tandem's cache has one)")
    meta = read.rows(n_cells, 12)  # per cell: position, 1 sequence, its id
    if not (meta.view(np.int32)[:, 1] == 1).all():
        raise StateFormatError("cells with per-cell extras or several sequences")
    v_trans, n_layer = read.take("<II")
    for part in (struct.pack("<II", 1, n_cells), meta, struct.pack("<II", v_trans, n_layer)):
        out.put(part)
    layers = []
    for _ in range(n_layer):
        k_type, row_bytes = read.take("<iQ")
        if k_type != _F16:
            raise StateFormatError(f"K of ggml type {k_type}, not F16")
        layers.append(read.rows(n_cells, row_bytes).view(np.float16))
    # Layers convert on both cores (numpy and ggml's kernels release the GIL) and are
    # written in order. In place that is safe: a layer's bytes are written only after
    # its conversion copied them, and never over a later layer's.
    for packed in _converter().map(lambda k: _layer_keys(k, n_head_kv, rotate), layers):
        out.put(struct.pack("<iQ", _Q8_0, packed.shape[1]))
        out.put(packed)
    if read.at == len(read.blob):
        return  # no V: latent attention keeps V as a view of K
    for _ in range(n_layer):  # V moves as it is
        if v_trans:  # (flash attention off) per layer: its type, element size, width,
            # then each of the width's values for every cell
            v_type, size_el, width = read.take("<iII")
            out.put(struct.pack("<iII", v_type, size_el, width))
            out.put(read.rows(width, n_cells * size_el))
        else:
            v_type, row_bytes = read.take("<iQ")
            out.put(struct.pack("<iQ", v_type, row_bytes))
            out.put(read.rows(n_cells, row_bytes))
