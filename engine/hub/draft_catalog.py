"""Which small language model drafts for which target: a catalog of same-family pairs.

A target matches a pair by its repository id (a pattern) or, more robustly, by what its
GGUF header says: the architecture and the model's name (a re-upload under any name
still says ``qwen2`` / "Qwen2.5 7B Instruct"). A match is only a recommendation: the
draft's vocabulary is checked against the target's header (llama.cpp's rules, from
ranged reads, engine.hub.draft_pairing) before anything is offered or downloaded."""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.gguf.header import GGUFFacts

log = logging.getLogger(__name__)

DRAFT_CATALOG_FILE = "draft_catalog.json"  # in Tandem's data directory: user additions
# Preferred draft quantizations, best first; the first that is small enough is taken.
DEFAULT_QUANTS = ("Q8_0", "Q4_K_M", "Q4_0")


@dataclass(frozen=True)
class DraftPair:
    """Targets of ``family`` take the draft model in ``draft_repo``. A target matches
    when its repo id matches ``target_pattern`` (fnmatch, case-insensitive) or its
    header's architecture is in ``architectures`` and its name matches ``name_regex``
    (re.search, case-insensitive)."""

    family: str
    target_pattern: str
    draft_repo: str
    architectures: tuple[str, ...] = ()
    name_regex: str = ""
    quants: tuple[str, ...] = DEFAULT_QUANTS
    _regex: re.Pattern[str] | None = field(default=None, init=False, repr=False,
                                           compare=False)

    def __post_init__(self) -> None:
        if self.name_regex:
            object.__setattr__(self, "_regex", re.compile(self.name_regex, re.IGNORECASE))

    def matches(self, target_repo: str, facts: GGUFFacts | None = None) -> bool:
        if target_repo.lower() == self.draft_repo.lower():
            return False  # a repository does not draft for itself
        if target_repo and fnmatch.fnmatch(target_repo.lower(), self.target_pattern.lower()):
            return True
        return (facts is not None and facts.architecture in self.architectures
                and self._regex is not None and bool(self._regex.search(facts.name or "")))


# Recommendations from the families' public releases (the pairings llama.cpp's presets,
# LM Studio's docs and users report: see shared docs, drafts-for-real-models.md 2.1).
# Each repository is a real public one, but nothing here is trusted blindly: the draft's
# header is read and checked against the target's before it is offered or downloaded,
# and one bigger than a quarter of the target is never offered.
KNOWN_DRAFTS: tuple[DraftPair, ...] = (
    # Llama 3.1/3.2/3.3 share one 128256-token vocabulary (3.0 renamed reserved tokens:
    # the header check catches that).
    DraftPair("Llama 3.x", "*llama-3*", "bartowski/Llama-3.2-1B-Instruct-GGUF",
              ("llama",), r"llama[\s_-]*3"),
    # Coder first: its own 0.5B drafts code better (llama.cpp's --fim-qwen-*-spec).
    DraftPair("Qwen2.5 Coder", "*qwen2.5-coder*", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
              ("qwen2",), r"qwen2\.5[\s_-]*coder"),
    DraftPair("Qwen2.5", "*qwen2.5*", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", ("qwen2",),
              r"qwen2\.5"),
    # Qwen3 dense and MoE, not Qwen3.5/3.6 (another vocabulary).
    DraftPair("Qwen3", "*qwen3-*", "Qwen/Qwen3-0.6B-GGUF", ("qwen3", "qwen3moe"),
              r"qwen3(?![.\d])"),
    # Gemma 3 (not 3n): 270M first (~1.8x on 12B reported), 1B for the big ones.
    DraftPair("Gemma 3", "*gemma-3-*", "unsloth/gemma-3-270m-it-GGUF", ("gemma3",),
              r"gemma[\s_-]*3(?!n)", ("Q8_0", "F16", "Q4_K_M")),
    DraftPair("Gemma 3", "*gemma-3-*", "unsloth/gemma-3-1b-it-GGUF", ("gemma3",),
              r"gemma[\s_-]*3(?!n)", ("Q4_K_M", "Q8_0")),
    # SmolLM2: the bundled model is SmolLM2-135M-Instruct, found locally without these.
    DraftPair("SmolLM2", "*smollm2*", "HuggingFaceTB/SmolLM2-360M-Instruct-GGUF", ("llama",),
              r"smollm2", ("Q8_0",)),
    DraftPair("SmolLM2", "*smollm2*", "bartowski/SmolLM2-135M-Instruct-GGUF", ("llama",),
              r"smollm2", ("Q8_0", "Q4_K_M")),
)


def _pair_from_json(entry: dict) -> DraftPair:
    return DraftPair(str(entry.get("family", "user")), str(entry["target_pattern"]),
                     str(entry["draft_repo"]), tuple(entry.get("architectures", ())),
                     str(entry.get("name_regex", "")),
                     tuple(entry.get("quants", DEFAULT_QUANTS)))


def load_draft_catalog(data_dir: Path | None = None) -> tuple[DraftPair, ...]:
    """The user's pairs from ``<data_dir>/draft_catalog.json`` first (a pair the user
    added is what they want offered), then the built-in ones. A broken file is logged
    and skipped: it must not stop the wizard. Format:
    [{"target_pattern": "*mistral-7b*", "draft_repo": "me/tiny-mistral-GGUF",
      "family": "Mistral", "architectures": ["llama"], "name_regex": "mistral",
      "quants": ["Q8_0"]}]"""
    return users_pairs(data_dir / DRAFT_CATALOG_FILE if data_dir else None) + KNOWN_DRAFTS


def users_pairs(path: Path | None) -> tuple[DraftPair, ...]:
    """The pairs of a user's catalog file (this format), none when there is no file; a
    broken one is logged and skipped."""
    if path is None or not path.is_file():
        return ()
    try:
        return tuple(_pair_from_json(e) for e in json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError, re.error) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return ()


def matching_pairs(target_repo: str, facts: GGUFFacts | None,
                   catalog: tuple[DraftPair, ...] = KNOWN_DRAFTS) -> list[DraftPair]:
    """The pairs for a target, catalog order, one per draft repository."""
    out: list[DraftPair] = []
    seen: set[str] = set()
    for pair in catalog:
        if pair.draft_repo.lower() not in seen and pair.matches(target_repo, facts):
            out.append(pair)
            seen.add(pair.draft_repo.lower())
    return out
