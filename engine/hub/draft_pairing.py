"""Draft models for a target, checked before anything is downloaded or loaded.

Two sources: the catalog's same-family drafts on the Hub (engine.hub.draft_catalog),
whose headers are read by ranged requests, and GGUFs already on this machine (the
registry's models and drafts, and the bundled SmolLM2-135M-Instruct), read from disk.
Each is checked with llama.cpp's vocabulary rules against the target's header, and
none bigger than a quarter of the target is offered: a draft's every token costs time,
and past that size it costs more than its accepted tokens save."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import TandemError
from engine.gguf.draft_compat import VocabFacts, describe, mismatches, unchecked
from engine.gguf.header import GGUFFacts
from engine.gguf.vocab_header import read_file_header
from engine.hub.draft_catalog import DraftPair
from engine.hub.local_models import ModelRegistry
from engine.hub.remote_header import MAX_HEADER_BYTES, read_remote_header
from engine.hub.search import GGUFChoice, list_repo

log = logging.getLogger(__name__)

MAX_DRAFT_FRACTION = 0.25  # of the target's bytes: what a draft may weigh at most
# engine.hub.model_store.PREPARED_FILE, in the registry's folder (not imported: that module
# loads llama.cpp, which listing models does not need).
BUNDLED_DRAFT_FILE = "SmolLM2-135M-Instruct.Q4_0.gguf"


def draft_limit(target_bytes: int) -> int:
    """The most bytes a draft for a target of ``target_bytes`` may have."""
    return int(target_bytes * MAX_DRAFT_FRACTION)


@dataclass(frozen=True)
class VocabCheck:
    """llama.cpp's compatibility rules applied to two headers: the rules broken
    (``problems``: field, draft's value, target's value) and those that could not be
    checked (a header read that ended early)."""

    problems: tuple[tuple[str, object, object], ...] = ()
    unchecked: tuple[str, ...] = ()

    @property
    def compatible(self) -> bool:
        """No rule broken (some may be unchecked: llama.cpp checks again at load)."""
        return not self.problems

    @property
    def confirmed(self) -> bool:
        """Every rule checked and none broken."""
        return not self.problems and not self.unchecked

    @property
    def verdict(self) -> str:
        if self.problems:
            return f"incompatible ({describe(list(self.problems))})"
        if self.unchecked:
            return f"not fully checked ({'; '.join(self.unchecked)})"
        return "compatible"


def check_vocab(draft: VocabFacts | None, target: VocabFacts | None) -> VocabCheck:
    if draft is None or target is None:
        which = "the draft's" if draft is None else "the target's"
        return VocabCheck(unchecked=(f"{which} vocabulary (no token list in its header)",))
    return VocabCheck(tuple(mismatches(draft, target)), tuple(unchecked(draft, target)))


@dataclass(frozen=True)
class RemoteDraft:
    """A catalog draft repository, its header checked once: a repository's
    quantizations are conversions of one checkpoint, with one vocabulary."""

    pair: DraftPair
    choices: tuple[GGUFChoice, ...]  # the pair's quantizations the repository has, in order
    facts: GGUFFacts | None
    check: VocabCheck

    def pick(self, target_bytes: int) -> GGUFChoice | None:
        """The first preferred quantization small enough for the target, if any."""
        limit = draft_limit(target_bytes)
        return next((c for c in self.choices if c.n_bytes <= limit), None)


@dataclass(frozen=True)
class LocalDraft:
    """A GGUF on this machine, checked against the target."""

    name: str
    path: str
    n_bytes: int
    facts: GGUFFacts | None
    check: VocabCheck


@dataclass(frozen=True)
class DraftOffer:
    """One draft model for one target choice: a file to download (``choice``) or one
    already here (``path``)."""

    label: str  # "owner/repo:Q8_0", or a local model's name
    source: str  # "local", or the catalog family ("Qwen2.5")
    n_bytes: int
    check: VocabCheck
    facts: GGUFFacts | None = None
    choice: GGUFChoice | None = None
    path: str | None = None

    @property
    def download_bytes(self) -> int:
        return 0 if self.choice is None else self.n_bytes


def _ordered_choices(pair: DraftPair, choices: list[GGUFChoice]) -> tuple[GGUFChoice, ...]:
    by_quant = {c.quant.upper(): c for c in choices}
    return tuple(by_quant[q.upper()] for q in pair.quants if q.upper() in by_quant)


def remote_drafts(pairs: Iterable[DraftPair], target: VocabFacts | None, *,
                  endpoint: str | None = None, max_header_bytes: int = MAX_HEADER_BYTES
                  ) -> list[RemoteDraft]:
    """List each pair's draft repository and check its header against ``target``. A
    repository that cannot be listed, or has none of the pair's quantizations, is left
    out (logged): one missing recommendation must not hide the others."""
    out = []
    for pair in pairs:
        try:
            choices = _ordered_choices(pair, list_repo(pair.draft_repo,
                                                       endpoint=endpoint).gguf_choices())
        except TandemError as exc:
            log.info("draft %s not listed: %s", pair.draft_repo, exc)
            continue
        if not choices:
            log.info("draft %s has none of %s", pair.draft_repo, ", ".join(pair.quants))
            continue
        header = read_remote_header(choices[0], endpoint=endpoint, max_bytes=max_header_bytes)
        out.append(RemoteDraft(pair, choices, header.facts if header else None,
                               check_vocab(header.vocab if header else None, target)))
    return out


def local_candidates(registry: ModelRegistry, extra: Iterable[str | Path] = ()
                     ) -> list[tuple[str, Path]]:
    """(name, path) of every GGUF on this machine that could draft: the bundled model,
    the registry's models and the drafts that came with them, and ``extra`` paths (the
    GUI's own list), once each, existing files only."""
    found: list[tuple[str, Path]] = []
    bundled = registry.path.parent / BUNDLED_DRAFT_FILE
    found.append(("SmolLM2-135M-Instruct (bundled)", bundled))
    for m in registry.list():
        found.append((m.name, Path(m.path)))
        if m.draft_path:
            found.append((m.draft_label, Path(m.draft_path)))
    found += [(Path(p).name, Path(p)) for p in extra]
    seen: set[Path] = set()
    out = []
    for name, path in found:
        key = path.resolve() if path.exists() else path
        if key not in seen and path.is_file():
            seen.add(key)
            out.append((name, path))
    return out


def local_drafts(target: VocabFacts | None, candidates: Iterable[tuple[str, Path]],
                 exclude: Path | None = None) -> list[LocalDraft]:
    """Check each local GGUF against ``target`` (headers only, cached per file). A
    file that is not a readable GGUF is left out; ``exclude`` is the target itself."""
    skip = exclude.resolve() if exclude is not None and exclude.exists() else None
    out = []
    for name, path in candidates:
        if skip is not None and path.resolve() == skip:
            continue
        try:
            facts, vocab = read_file_header(path)
        except (TandemError, ValueError, OSError) as exc:
            log.info("not a draft candidate: %s: %s", path, exc)
            continue
        out.append(LocalDraft(name, str(path), path.stat().st_size, facts,
                              check_vocab(vocab, target)))
    return out


def offers_for(target_bytes: int, local: Iterable[LocalDraft],
               remote: Iterable[RemoteDraft]) -> list[DraftOffer]:
    """The drafts for one target choice, small enough for it: compatible local files
    first (nothing to download), then each catalog repository's best quantization that
    fits, compatible or not (callers show why one is not offered)."""
    limit = draft_limit(target_bytes)
    out = [DraftOffer(d.name, "local", d.n_bytes, d.check, d.facts, path=d.path)
           for d in local if d.check.confirmed and d.n_bytes <= limit]
    for r in remote:
        choice = r.pick(target_bytes)
        if choice is not None:
            out.append(DraftOffer(f"{choice.repo_id}:{choice.quant}", r.pair.family,
                                  choice.n_bytes, r.check, r.facts, choice=choice))
    return out


def best_offer(offers: Iterable[DraftOffer]) -> DraftOffer | None:
    """The draft to take by default: the first compatible one."""
    return next((o for o in offers if o.check.compatible), None)


def compatible_local_drafts(target_path: Path, candidates: Iterable[tuple[str, Path]]
                            ) -> list[LocalDraft]:
    """Local drafts for a local target: compatible by header and at most a quarter of
    its size. Header reads only (cached), so a GUI may call it when a model is picked.
    Raises ModelLoadError or ValueError when the target's header cannot be read."""
    _, target = read_file_header(target_path)
    if target is None:
        return []  # nothing to check a draft against
    limit = draft_limit(target_path.stat().st_size)
    return [d for d in local_drafts(target, candidates, exclude=target_path)
            if d.check.confirmed and d.n_bytes <= limit]
