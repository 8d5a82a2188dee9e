"""Every x86 repacked kernel of the CPU library ggml loaded multiplies a row inside a batch
bit for bit as it multiplies that row alone (packaging/llama-cpp/batch-invariant-repack.patch).

ggml's repack.cpp quantizes a batch's rows in groups of 4 (ggml_quantize_mat_*) for the
4-row GEMM and the rest one at a time (quantize_row_*) for the one-row GEMV. This calls
those functions of the library directly, as forward_mul_mat_one_chunk does, for batches of
2 to 33 rows, and compares every row with the same row alone, as bits. Random bytes are
valid repacked weights once their scales are finite, so no model is needed; 72 columns take
both the 16-column AVX-512 loops and the 8-column tail, 33 rows the 16-row loops.

A self-check of the build, not of Tandem's logic: tests/test_repack_kernels.py runs it on
the library this process loaded, and ``tandem check-cpu`` on each CPU library of a
portable build in turn.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass, field

import numpy as np

from engine.runtime.native import ggml_cpu_library

QK_K = 256
N_IN = 2048  # the shared dimension: 8 K-quant super blocks, 64 Q8_0 blocks
N_OUT = 72
MAX_BATCH = 33  # the longest chain a memory draft verifies


@dataclass(frozen=True)
class RepackedKernel:
    name: str  # ggml_gemv_<name> / ggml_gemm_<name>
    block: int  # weights per row in one block
    group_bytes: int  # one block of 8 interleaved rows
    scales: tuple[tuple[int, int, str], ...]  # (offset, count, "f16" | "e8m0") in a group
    activation: str  # "q8_0" or "q8_K"
    needs: str = "avx2"  # the instruction set llama.cpp picks this layout on

    @property
    def row_bytes(self) -> int:  # one quantized activation block, one row
        return 34 if self.activation == "q8_0" else 292

    @property
    def rows4_bytes(self) -> int:  # one quantized activation block, 4 rows interleaved
        return 136 if self.activation == "q8_0" else 1168


# What ggml_repack_get_optimal_repack_type picks on x86 (ggml-cpu/repack.cpp).
KERNELS = (
    RepackedKernel("q4_0_8x8_q8_0", 32, 144, ((0, 8, "f16"),), "q8_0"),
    RepackedKernel("iq4_nl_8x8_q8_0", 32, 144, ((0, 8, "f16"),), "q8_0"),
    RepackedKernel("mxfp4_8x8_q8_0", 32, 136, ((0, 8, "e8m0"),), "q8_0"),
    RepackedKernel("q4_K_8x8_q8_K", QK_K, 1152, ((0, 16, "f16"),), "q8_K"),
    RepackedKernel("q2_K_8x8_q8_K", QK_K, 672, ((0, 16, "f16"),), "q8_K", needs="avx512"),
)


def cpu_has(lib: ctypes.CDLL, feature: str) -> bool:
    """What the CPU library was built for (a portable build's level, not the CPU)."""
    return bool(getattr(lib, f"ggml_cpu_has_{feature}")())


def _weights(kernel: RepackedKernel, rng: np.random.Generator) -> np.ndarray:
    """Random repacked weights for N_OUT rows with finite, modest scales."""
    groups = rng.integers(0, 256, size=(N_OUT // 8, N_IN // kernel.block, kernel.group_bytes),
                          dtype=np.uint8)
    for offset, count, kind in kernel.scales:
        if kind == "f16":
            scale = (rng.random(groups.shape[:2] + (count,)) * 0.01 + 1e-3).astype(np.float16)
            groups[:, :, offset:offset + 2 * count] = scale.view(np.uint8)
        else:  # E8M0: a power of two, near 2^-6
            groups[:, :, offset:offset + count] = rng.integers(118, 124, size=groups.shape[:2]
                                                               + (count,), dtype=np.uint8)
    return np.ascontiguousarray(groups)


def _activations(rng: np.random.Generator) -> np.ndarray:
    """Hidden-state-like rows, some with a tie for the largest magnitude of opposite signs
    (the negative first): there the 4-row Q8_K quantizer takes the other sign than
    quantize_row_q8_K_ref, which negates the quants and the scale alike (exact)."""
    x = (rng.standard_normal((MAX_BATCH, N_IN)) * 0.5).astype(np.float32)
    for row in range(1, MAX_BATCH, 3):
        block = rng.integers(0, N_IN // QK_K)
        i, j = sorted(rng.choice(QK_K, size=2, replace=False))
        x[row, block * QK_K + i] = -4.0
        x[row, block * QK_K + j] = 4.0
    return x


class Caller:
    """The kernel's quantizers, GEMV and GEMM, called as ggml's repack.cpp calls them."""

    def __init__(self, lib: ctypes.CDLL, kernel: RepackedKernel) -> None:
        self.k = kernel
        self.gemv = getattr(lib, f"ggml_gemv_{kernel.name}")
        self.gemm = getattr(lib, f"ggml_gemm_{kernel.name}")
        self.quantize_row = getattr(lib, f"quantize_row_{kernel.activation}")
        self.quantize_4 = getattr(lib, f"ggml_quantize_mat_{kernel.activation}_4x8")
        for f in (self.gemv, self.gemm, self.quantize_row, self.quantize_4):
            f.restype = None

    @staticmethod
    def _p(a: np.ndarray) -> ctypes.c_void_p:
        return a.ctypes.data_as(ctypes.c_void_p)

    def alone(self, w: np.ndarray, row: np.ndarray) -> np.ndarray:
        q = np.zeros(N_IN // self.k.block * self.k.row_bytes, np.uint8)
        self.quantize_row(self._p(row), self._p(q), ctypes.c_int64(N_IN))
        out = np.zeros(N_OUT, np.float32)
        self.gemv(ctypes.c_int(N_IN), self._p(out), ctypes.c_size_t(N_OUT), self._p(w),
                  self._p(q), ctypes.c_int(1), ctypes.c_int(N_OUT))
        return out

    def batch(self, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The batch as forward_mul_mat_one_chunk multiplies it: whole groups of 4 rows
        through the GEMM, the rest one by one through the GEMV."""
        n = len(rows)
        grouped = n - n % 4
        out = np.zeros((n, N_OUT), np.float32)
        if grouped:
            per_group = N_IN // self.k.block * self.k.rows4_bytes
            q = np.zeros(grouped // 4 * per_group, np.uint8)
            for g in range(grouped // 4):
                src = np.ascontiguousarray(rows[4 * g:4 * g + 4])
                self.quantize_4(self._p(src), self._p(q[g * per_group:]), ctypes.c_int64(N_IN))
            self.gemm(ctypes.c_int(N_IN), self._p(out), ctypes.c_size_t(N_OUT), self._p(w),
                      self._p(q), ctypes.c_int(grouped), ctypes.c_int(N_OUT))
        for r in range(grouped, n):
            out[r] = self.alone(w, np.ascontiguousarray(rows[r]))
        return out


@dataclass(frozen=True)
class KernelCheck:
    kernel: str
    # "exact"; "differs"; "not built" (the library has no such layout: a level without
    # the instructions it needs); "not x86"
    status: str
    differing: dict[int, int] = field(default_factory=dict)  # batch size -> rows differing

    @property
    def failed(self) -> bool:
        return self.status == "differs"


def check_kernel(lib: ctypes.CDLL, kernel: RepackedKernel, seed: int = 7) -> KernelCheck:
    """Every row of every batch size against the row alone, compared as bits."""
    if not cpu_has(lib, kernel.needs):
        return KernelCheck(kernel.name, f"not built (llama.cpp repacks it with {kernel.needs})")
    caller = Caller(lib, kernel)
    rng = np.random.default_rng(seed)
    w, x = _weights(kernel, rng), _activations(rng)
    alone = np.stack([caller.alone(w, np.ascontiguousarray(r)) for r in x])
    if not (np.isfinite(alone).all() and np.abs(alone).max() > 0):
        raise ValueError(f"{kernel.name}: the row alone gave no finite, nonzero output")
    differing = {}
    for size in range(2, MAX_BATCH + 1):
        got = caller.batch(w, x[:size])
        bad = int((got.view(np.uint32) != alone[:size].view(np.uint32)).sum())
        if bad:
            differing[size] = bad
    return KernelCheck(kernel.name, "differs" if differing else "exact", differing)


def check_loaded_library() -> list[KernelCheck]:
    """Each repacked kernel of the CPU library this process runs."""
    lib = ggml_cpu_library() if platform.machine() in ("x86_64", "AMD64") else None
    if lib is None:
        return [KernelCheck(k.name, "not x86") for k in KERNELS]
    lib.ggml_cpu_init()  # fills the FP16 tables some kernels read scales through
    return [check_kernel(lib, k) for k in KERNELS]
