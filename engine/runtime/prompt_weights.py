"""Which weight layout prefills a prompt fastest, read from the GGUF's tensor types.

With the prompt kernels on (engine.runtime.native.prompt_kernels), K-quants and most
i-quants go through ggml's tiled matmul, but only where they are not repacked: the tiled
kernel leaves repacked weights to repack's own GEMM. So a Q4_K_M prompt is sooner with
plain weights, and a Q4_0 one (no tiled kernel) with repacked weights (docs/benchmarks.md:
figures behind the code's rules, "Reading prompts")."""

from __future__ import annotations

import platform
from pathlib import Path

from gguf import GGMLQuantizationType

from engine.gguf.header import read_tensor_infos

# Types ggml's tiled matmul takes (ggml-cpu/tiled/tiled.cpp, x86 only) that repack.cpp
# also repacks on x86: their layout decides which kernel a prompt gets. Other tiled types
# (Q6_K, Q3_K, i-quants) get the tiled kernel either way.
TILED_WHEN_PLAIN = frozenset(GGMLQuantizationType[name] for name in ("Q4_K", "Q2_K"))
# Repacked, with no tiled kernel: repacking is their fast prompt layout.
REPACK_ONLY_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "Q4_0", "IQ4_NL", "Q8_0"))
# Rows looked up (the embeddings), or one row multiplied (the LM head, for the last prompt
# token only): their layout does not make a prompt faster.
PROMPT_IDLE_TENSORS = frozenset({"token_embd.weight", "output.weight"})


def _weight_bytes(path: Path) -> dict[GGMLQuantizationType, int]:
    read = read_tensor_infos(path)
    if read is None:
        return {}
    totals: dict[GGMLQuantizationType, int] = {}
    for info in read[1]:
        if info.name in PROMPT_IDLE_TENSORS:
            continue
        try:
            kind = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            continue
        totals[kind] = totals.get(kind, 0) + info.n_bytes
    return totals


def prompts_prefer_repacked(path: Path) -> bool | None:
    """Whether repacked weights prefill this file faster than plain ones with the prompt
    kernels: more of its bytes in types that only repacking speeds up (True) or in types
    the tiled matmul takes unless they are repacked (False). None when neither outweighs
    (floats; an unreadable header): the layout does not matter to its prompts."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True  # no tiled kernel there: repacking is the fast layout
    totals = _weight_bytes(path)
    tiled = sum(b for t, b in totals.items() if t in TILED_WHEN_PLAIN)
    repack_only = sum(b for t, b in totals.items() if t in REPACK_ONLY_TYPES)
    if tiled == repack_only:
        return None
    return repack_only > tiled
