"""Importance matrices for the weight types llama.cpp will not make without one.

IQ1_S/M, IQ2_XXS/XS/S/M, IQ3_XXS (and Q2_K_S's Q2_K tensors) are quantized by weighing each
input column's error; llama.cpp's quantizer refuses them without that weighting, which
users' files got from ``llama-imatrix`` over a calibration text. A flat matrix (every
column equally important) is the weighting that matrix starts from: it makes the types,
kernels and file layout users download, with the plain unweighted error. What Tandem
makes with it is for tests and benchmarks of those kernels; the answers of a file quantized
from real activations are better, its kernels the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# llama.cpp's file types whose tensors need (or may need) an importance matrix, by the
# names ``tandem synth --type`` takes (src/llama-quant.cpp, tensor_requires_imatrix).
NEEDS_IMPORTANCE = frozenset({"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m",
                              "iq3_xxs", "iq3_xs", "q2_k_s"})


def needs_importance(type_name: str) -> bool:
    return type_name.strip().lower() in NEEDS_IMPORTANCE


def flat_importance(path: Path) -> dict[str, np.ndarray]:
    """Every matrix's name -> ones, one per input column and expert (llama.cpp checks the
    length against the tensor's first and third dimensions)."""
    from engine.gguf.header import read_tensor_infos

    table = read_tensor_infos(path)
    if table is None:
        raise ValueError(f"{path}: the GGUF's tensor table cannot be read")
    matrices = {}
    for tensor in table[1]:
        shape = tensor.dims  # llama.cpp's order: columns first
        if len(shape) < 2:
            continue
        experts = shape[2] if len(shape) > 2 else 1
        matrices[tensor.name] = np.ones(shape[0] * experts, dtype=np.float32)
    return matrices
