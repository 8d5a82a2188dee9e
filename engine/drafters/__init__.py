"""Every drafter (memory, prompt lookup, draft head, draft model, head and memory merged,
llama.cpp's EAGLE-3 heads and MTP blocks), the suffix index drafts from memory read,
and the one way to open one: every entry point (CLI, bench, app, calibration) asks here.

- ``engine.drafters.kinds``: the registry, one ``DrafterKind`` per drafter (its name,
  label, needs and traits); the one vocabulary of the plan, the engine and the window.
- ``engine.drafters.spec``: ``DrafterSpec``, a kind with its files, device and options.
- ``engine.drafters.factory``: how each kind is built (``build_drafter``), no fallback.
- ``engine.drafters.fallback``: ``open_drafter``, the one fallback policy: the head on
  its GPU, then on the CPU, then drafts from memory; a drafter that cannot be built at
  all means plain decoding.
- ``engine.drafters.memory_file``: the model's memory of earlier answers on disk.

May import: ``engine.runtime``, ``engine.gguf``, ``engine.errors``, ``models``.
"""

from __future__ import annotations

from engine.drafters.base import Drafter
from engine.drafters.factory import (
    build_drafter,
    make_drafter,
    open_draft_model,
    target_fingerprint,
)
from engine.drafters.fallback import open_drafter
from engine.drafters.kinds import (
    CHOICES,
    DRAFTER_LABELS,
    DRAFTER_NAMES,
    HEAD_DRAFTERS,
    OFFERED_DRAFTERS,
    DrafterKind,
    Need,
    is_plain,
)
from engine.drafters.lookup import LookupConfig, PromptLookupDrafter
from engine.drafters.memory import MemoryDrafter
from engine.drafters.spec import DEFAULT_EAGLE3_HEAD, DEFAULT_HEAD_DIR, DrafterSpec

__all__ = ["CHOICES", "DEFAULT_EAGLE3_HEAD", "DEFAULT_HEAD_DIR", "DRAFTER_LABELS",
           "DRAFTER_NAMES", "HEAD_DRAFTERS", "OFFERED_DRAFTERS", "Drafter", "DrafterKind",
           "DrafterSpec", "LookupConfig", "MemoryDrafter", "Need", "PromptLookupDrafter",
           "build_drafter", "is_plain", "make_drafter", "open_draft_model", "open_drafter",
           "target_fingerprint"]
