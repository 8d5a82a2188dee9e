"""Public EAGLE-3 heads for the families Tandem knows, checked against a target before any
download, then fetched and written as the ``eagle3`` GGUF llama.cpp runs.

A head repository ships ``config.json`` and safetensors for the Hugging Face model (the
EAGLE, SpecForge and RedHat speculators layouts, engine.gguf.eagle3_import). Its config
says the width of the target it reads, the vocabulary it was trained with and the three
target layers it taps: those are compared with the target's GGUF header (read with
ranged requests) before anything is offered. A target matches a head as a draft model
matches (engine.hub.draft_catalog): by its repository id or its header's architecture
and name, so a re-upload under another name still finds its head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.gguf.header import GGUFFacts
from engine.hub.download import Downloader, DownloadItem, ProgressFn
from engine.hub.draft_catalog import DraftPair, matching_pairs, users_pairs
from engine.hub.remote import fetch_prefix, resolve_url
from engine.hub.search import RemoteFile, list_repo

EAGLE3_CATALOG_FILE = "eagle3_catalog.json"  # in Tandem's data directory: user additions
PUBLIC_FAMILIES = "Llama 3.1 8B, Llama 3.3 70B, Qwen3 1.7B-32B and 30B-A3B"
# Variants llama.cpp runs that Tandem's writer does not write yet.
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc")

# The public heads of drafts-for-real-models.md (shared docs), one pair per head; the
# ``draft_repo`` field holds the head's repository. Sizes in a name pattern keep a head
# for an 8B off a 70B of the same family; the config check catches the rest.
KNOWN_EAGLE3_HEADS: tuple[DraftPair, ...] = (
    DraftPair("Llama 3.1 8B", "*llama-3.1-8b*", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
              ("llama",), r"llama[\s_-]*3\.1.*\b8b"),
    DraftPair("Llama 3.1 8B", "*llama-3.1-8b*",
              "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", ("llama",),
              r"llama[\s_-]*3\.1.*\b8b"),
    DraftPair("Llama 3.3 70B", "*llama-3.3-70b*", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
              ("llama",), r"llama[\s_-]*3\.3.*\b70b"),
    *(DraftPair(f"Qwen3 {size}", f"*qwen3-{size.lower()}*", f"AngelSlim/Qwen3-{size}_eagle3",
                ("qwen3",), r"qwen3(?![.\d])[\s_-]*" + pattern + r"\b")
      for size, pattern in (("1.7B", r"1\.7b"), ("4B", "4b"), ("8B", "8b"), ("14B", "14b"),
                            ("32B", "32b"))),
    DraftPair("Qwen3 8B", "*qwen3-8b*", "RedHatAI/Qwen3-8B-speculator.eagle3", ("qwen3",),
              r"qwen3(?![.\d])[\s_-]*8b\b"),
    DraftPair("Qwen3 32B", "*qwen3-32b*", "RedHatAI/Qwen3-32B-speculator.eagle3", ("qwen3",),
              r"qwen3(?![.\d])[\s_-]*32b\b"),
    DraftPair("Qwen3 30B-A3B", "*qwen3-30b-a3b*", "AngelSlim/Qwen3-a3B_eagle3", ("qwen3moe",),
              r"qwen3(?![.\d])[\s_-]*30b[\s_-]*a3b"),
)


def load_eagle3_catalog(data_dir: Path | None = None) -> tuple[DraftPair, ...]:
    """The user's pairs from ``<data_dir>/eagle3_catalog.json`` first, then the built-in
    ones; a broken file is logged and skipped. Format as draft_catalog.json's, with the
    head's repository as ``draft_repo``."""
    return users_pairs(data_dir / EAGLE3_CATALOG_FILE if data_dir else None) + \
        KNOWN_EAGLE3_HEADS


@dataclass(frozen=True)
class Eagle3Offer:
    """A catalog head for a target: whether its config fits (None: not known, it could not
    be read) and why, and the files to fetch."""

    repo_id: str
    family: str
    fits: bool | None
    verdict: str
    commit: str = ""
    files: tuple[RemoteFile, ...] = ()

    @property
    def n_bytes(self) -> int:
        return sum(f.n_bytes for f in self.files)

    def line(self) -> str:
        mark = {True: "fits", False: "does not fit", None: "not checked"}[self.fits]
        return f"{self.repo_id} ({mark}: {self.verdict})"


def config_fit(config: dict, facts: GGUFFacts | None) -> tuple[bool, str]:
    """Whether a head with this config.json reads a target with these header facts, and
    why in words: the target's width, its vocabulary, the layers it taps, the variant."""
    merged = {**config, **config.get("transformer_layer_config", {})}
    if "draft_vocab_size" not in merged and "speculators_config" not in config:
        return False, "its config is not an EAGLE-3 head's (no draft_vocab_size)"
    flags = [f for f in _UNSUPPORTED_FLAGS if merged.get(f)]
    if flags:
        return False, f"it uses {', '.join(flags)}, which Tandem's writer does not support yet"
    width = merged.get("target_hidden_size") or merged.get("hidden_size")
    vocab = merged.get("vocab_size")
    layers = merged.get("eagle_aux_hidden_state_layer_ids") or []
    if facts is None:
        return True, "the target's header could not be read to check it"
    if width and facts.hidden_size and int(width) != facts.hidden_size:
        return False, f"it reads a target of width {width}, this one's is {facts.hidden_size}"
    if vocab and facts.vocab_size and int(vocab) != facts.vocab_size:
        return False, (f"it was trained with a {vocab}-token vocabulary, this model has "
                       f"{facts.vocab_size}")
    if layers and facts.n_layers and max(int(i) for i in layers) >= facts.n_layers:
        return False, f"it taps layer {max(layers)}, this model has {facts.n_layers} layers"
    draft_vocab = merged.get("draft_vocab_size")
    return True, (f"width {width}, vocabulary {vocab or facts.vocab_size}"
                  + (f", drafts from {draft_vocab} tokens" if draft_vocab else ""))


def offer_for(repo_id: str, facts: GGUFFacts | None, endpoint: str | None,
              family: str = "") -> Eagle3Offer:
    """The head in ``repo_id``, its config checked against ``facts`` (nothing else is
    fetched)."""
    try:
        listing = list_repo(repo_id, endpoint=endpoint)
        config = json.loads(fetch_prefix(resolve_url(repo_id, "config.json", listing.commit,
                                                     endpoint), 1 << 20))
    except Exception as exc:  # noqa: BLE001 - one unreachable head must not end the listing
        return Eagle3Offer(repo_id, family, None, f"its config could not be read ({exc})")
    files = tuple(f for f in listing.files
                  if f.filename == "config.json" or f.filename.endswith(".safetensors"))
    fits, verdict = config_fit(config, facts)
    if fits and not any(f.filename.endswith(".safetensors") for f in files):
        fits, verdict = False, "it has no safetensors weights (Tandem does not load pickles)"
    return Eagle3Offer(repo_id, family, fits, verdict, listing.commit, files)


def eagle3_offers(target_repo: str, facts: GGUFFacts | None, *,
                  catalog: tuple[DraftPair, ...] = KNOWN_EAGLE3_HEADS,
                  endpoint: str | None = None) -> list[Eagle3Offer]:
    """The catalog's heads for ``target_repo``, each checked against ``facts``; fitting
    ones first."""
    offers = [offer_for(p.draft_repo, facts, endpoint, p.family)
              for p in matching_pairs(target_repo, facts, catalog)]
    return sorted(offers, key=lambda o: o.fits is not True)


def eagle3_summary(offers: list[Eagle3Offer]) -> str:
    """One line for the wizard and ``tandem models search --repo``."""
    fitting = [o for o in offers if o.fits]
    if fitting:
        return (f"EAGLE-3 head: {fitting[0].repo_id} fits ({fitting[0].verdict}); after the "
                f"model: tandem models get-eagle3 {fitting[0].repo_id} --model MODEL")
    if offers:
        return "EAGLE-3 head: none fits: " + "; ".join(o.line() for o in offers)
    return ("EAGLE-3 head: none known for this family (public heads: "
            f"{PUBLIC_FAMILIES}; {EAGLE3_CATALOG_FILE} in the data directory adds more)")


def fetch_eagle3_head(offer: Eagle3Offer, target: Path, out: Path, downloader: Downloader,
                      on_progress: ProgressFn | None = None, matrices: str = "q8_0") -> Path:
    """Download the head's config and safetensors (checked, resumable, into the Hub cache)
    and write it as an ``eagle3`` GGUF for the local ``target`` at ``out``. Raises what
    Downloader.run raises, or ValueError when the head does not fit the target."""
    from engine.gguf.eagle3_import import import_eagle3_head

    if not offer.files:
        raise ValueError(f"{offer.repo_id}: nothing to download ({offer.verdict})")
    items = tuple(DownloadItem(offer.repo_id, offer.commit, f.filename, f.n_bytes, f.etag)
                  for f in offer.files)
    result = downloader.run(items, None, on_progress)
    return import_eagle3_head(result.paths[0].parent, target, out, matrices=matrices)
