"""Models to suggest on a first start: a short list of popular instruct GGUFs, the ones
that fit this machine (engine.runtime.memory_fit), each with the speed to expect here and
what drafts for it.

The speed is an estimate from this machine's memory bandwidth, measured once (one
thread copying 256 MB, about 0.1 s, cached): one token reads every weight once, so a
model of S bytes decodes at about ``DECODE_SHARE`` x bandwidth / S tokens a second. On the
2-core EPYC the measured shapes in tests/profiles read their weights at 1.4x (a 1.7B) to
1.7-1.9x (7-8B) that one-thread copy figure (24 GB/s): the decode's threads read in
parallel; the estimate takes the lowest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.hub.fit import FITS_GPU, TOO_LARGE, MachineMemory, estimate_fit

DECODE_SHARE = 1.4
BANDWIDTH_FILE = "bandwidth.json"
COPY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Suggested:
    """A model the wizard can fetch: its repository, the file's quantization and size
    (from the Hub, rounded), and what drafts for it."""

    name: str
    repo: str
    quant: str
    size_bytes: int
    drafts: str  # in words: "its own MTP layers", "Qwen3-0.6B as a draft model"...
    # How its chat template writes tool calls (engine.tool_syntax), "" when it has none
    tools: str = ""


# Popular instruct models of 0.5-8 B parameters, smallest first (sizes of the Q4_K_M files).
SUGGESTED = (
    Suggested("Qwen3 1.7B", "unsloth/Qwen3-1.7B-GGUF", "Q4_K_M", 1_110_000_000,
              "Qwen3-0.6B as a draft model, or an EAGLE-3 head", "hermes"),
    Suggested("Gemma 3 1B", "unsloth/gemma-3-1b-it-GGUF", "Q4_K_M", 806_000_000,
              "earlier answers"),
    Suggested("Llama 3.2 3B", "unsloth/Llama-3.2-3B-Instruct-GGUF", "Q4_K_M", 2_020_000_000,
              "Llama 3.2 1B as a draft model", "llama3"),
    Suggested("Qwen3 4B", "unsloth/Qwen3-4B-GGUF", "Q4_K_M", 2_500_000_000,
              "Qwen3-0.6B as a draft model, or an EAGLE-3 head", "hermes"),
    Suggested("Phi-3 mini", "microsoft/Phi-3-mini-4k-instruct-gguf", "Q4_K_M",
              2_390_000_000, "earlier answers"),
    Suggested("Llama 3.1 8B", "unsloth/Meta-Llama-3.1-8B-Instruct-GGUF", "Q4_K_M",
              4_920_000_000, "an EAGLE-3 head, or Llama 3.2 1B as a draft model", "llama3"),
    Suggested("Qwen3 8B", "unsloth/Qwen3-8B-GGUF", "Q4_K_M", 5_030_000_000,
              "Qwen3-0.6B as a draft model, or an EAGLE-3 head", "hermes"),
)
SUGGESTED_CTX = 4096  # the context a suggestion's KV cache is counted for: a chat's


@dataclass(frozen=True)
class Suggestion:
    model: Suggested
    where: str  # "on the GPU" or "in memory"
    tok_per_s: float  # expected decode speed here

    def describe(self) -> str:
        gb = self.model.size_bytes / 1e9
        tools = "; calls tools" if self.model.tools else ""
        return (f"{self.model.name} ({self.model.quant}, {gb:.1f} GB): about "
                f"{self.tok_per_s:.0f} tokens/s here {self.where}; drafting: "
                f"{self.model.drafts}{tools}")


def suggestions(memory: MachineMemory, bandwidth: float, most: int = 4
                ) -> list[Suggestion]:
    """Up to ``most`` suggestions that fit, largest first (the best that runs here)."""
    found = []
    for model in SUGGESTED:
        # The wizard's own label (engine.hub.fit): the header is not read before a
        # download, so the KV cache is estimated from the weights' size.
        label = estimate_fit(model.size_bytes, 0, SUGGESTED_CTX, None, memory).label
        if label == TOO_LARGE:
            continue
        where = "on the GPU" if label == FITS_GPU else "in memory"
        found.append(Suggestion(model, where, expected_tok_per_s(model.size_bytes,
                                                                 bandwidth)))
    found.sort(key=lambda s: s.model.size_bytes, reverse=True)
    return found[:most]


def expected_tok_per_s(size_bytes: float, bandwidth: float) -> float:
    return DECODE_SHARE * bandwidth / max(1.0, size_bytes)


def memory_bandwidth(cache_dir: Path | None = None) -> float:
    """Bytes a second this machine copies (read and write counted once each), measured
    once and kept in ``cache_dir``."""
    path = cache_dir / BANDWIDTH_FILE if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return float(json.loads(path.read_text())["bytes_per_s"])
        except (ValueError, KeyError, TypeError):
            pass
    src = np.ones(COPY_BYTES // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    bandwidth = 2 * COPY_BYTES / best
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"bytes_per_s": bandwidth}))
    return bandwidth
