"""One repository's models, each with the draft that goes with it and the fit of both:
what the wizard's table and ``tandem models search --repo`` show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.gguf.header import GGUFFacts
from engine.hub.catalog import KNOWN_HEADS, HeadChoice, HeadPair, matching_heads
from engine.hub.draft_catalog import KNOWN_DRAFTS, DraftPair, matching_pairs
from engine.hub.draft_pairing import (
    DraftOffer,
    LocalDraft,
    RemoteDraft,
    best_offer,
    local_candidates,
    local_drafts,
    offers_for,
    remote_drafts,
)
from engine.hub.eagle3_catalog import KNOWN_EAGLE3_HEADS, Eagle3Offer, eagle3_offers
from engine.hub.fit import FitEstimate, MachineMemory, estimate_fit
from engine.hub.local_models import ModelRegistry
from engine.hub.remote_header import MAX_HEADER_BYTES, RemoteHeader, read_remote_header
from engine.hub.search import GGUFChoice, list_repo


class TargetRow(NamedTuple):
    """One quantization: its fit with the default draft (and head), and its drafts."""

    choice: GGUFChoice
    fit: FitEstimate
    drafts: tuple[DraftOffer, ...]  # small enough for it; local ones all compatible

    @property
    def default_draft(self) -> DraftOffer | None:
        return best_offer(self.drafts)


@dataclass(frozen=True)
class RepoPairing:
    repo_id: str
    n_ctx: int
    rows: tuple[TargetRow, ...]
    heads: tuple[HeadChoice, ...]
    remote: tuple[RemoteDraft, ...]  # the catalog's drafts, checked (any size)
    local: tuple[LocalDraft, ...]  # this machine's GGUFs, checked (any size)
    header: RemoteHeader | None  # the target's
    memory: MachineMemory
    eagle3: tuple[Eagle3Offer, ...] = ()  # the catalog's EAGLE-3 heads, checked

    @property
    def facts(self) -> GGUFFacts | None:
        return self.header.facts if self.header else None

    def fit(self, choice: GGUFChoice, head: HeadChoice | None,
            draft: DraftOffer | None) -> FitEstimate:
        """The fit of ``choice`` with this head and draft (both optional)."""
        return fit_with(choice, head, draft, self.n_ctx, self.facts, self.memory)


def fit_with(choice: GGUFChoice, head: HeadChoice | None, draft: DraftOffer | None,
             n_ctx: int, facts: GGUFFacts | None, memory: MachineMemory) -> FitEstimate:
    return estimate_fit(choice.n_bytes, head.n_bytes if head else 0, n_ctx, facts, memory,
                        draft_bytes=draft.n_bytes if draft else 0,
                        draft_facts=draft.facts if draft else None)


def pair_repo(repo_id: str, n_ctx: int, memory: MachineMemory, *,
              head_catalog: tuple[HeadPair, ...] = KNOWN_HEADS,
              draft_catalog: tuple[DraftPair, ...] = KNOWN_DRAFTS,
              registry: ModelRegistry | None = None, endpoint: str | None = None,
              max_header_bytes: int = MAX_HEADER_BYTES,
              eagle3_catalog: tuple[DraftPair, ...] = KNOWN_EAGLE3_HEADS) -> RepoPairing:
    """List ``repo_id``, read its header (shape and vocabulary), find its draft heads,
    its catalog drafts on the Hub, the compatible GGUFs on this machine (from
    ``registry``) and the catalog's EAGLE-3 heads (their configs checked against the
    header), and fit each quantization with its default draft and first head.
    Raises NetworkUnavailableError or HubServerError when the repository cannot be
    listed; a draft that cannot be read is only left out."""
    choices = list_repo(repo_id, endpoint=endpoint).gguf_choices()
    header = (read_remote_header(choices[0], endpoint=endpoint, max_bytes=max_header_bytes)
              if choices else None)
    facts = header.facts if header else None
    vocab = header.vocab if header else None
    heads = tuple(matching_heads(repo_id, facts, catalog=head_catalog, endpoint=endpoint))
    remote = tuple(remote_drafts(matching_pairs(repo_id, facts, draft_catalog), vocab,
                                 endpoint=endpoint, max_header_bytes=max_header_bytes))
    local = tuple(local_drafts(vocab, local_candidates(registry))
                  if registry is not None and vocab is not None else ())
    head = heads[0] if heads else None
    rows = []
    for c in choices:
        offers = tuple(offers_for(c.n_bytes, local, remote))
        rows.append(TargetRow(c, fit_with(c, head, best_offer(offers), n_ctx, facts, memory),
                              offers))
    eagle3 = tuple(eagle3_offers(repo_id, facts, catalog=eagle3_catalog, endpoint=endpoint))
    return RepoPairing(repo_id, n_ctx, tuple(rows), heads, remote, local, header, memory,
                       eagle3)
