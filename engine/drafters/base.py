"""The drafter lifecycle every drafter follows: begin, draft, accept, stats."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.drafters.kinds import DrafterKind
from engine.runtime.draft_tree import DraftTree


class Drafter(ABC):
    """Proposes tokens for the target to verify.

    Contract (what keeps speculative sampling exact): ``draft`` is a function of the
    context the drafter has seen, never of the verifier's random draws, and siblings in a
    tree carry distinct tokens.
    """

    name: str = "drafter"
    # Its entry in the registry (engine.drafters.kinds); None: a drafter from elsewhere
    # (a test's): it keeps no acceptance record and the engine saves no memory for it.
    kind: DrafterKind | None = None
    # The file it drafts with beside the target (a draft model's or head's GGUF): the
    # pair whose acceptance record its answers correct.
    path: Path | None = None
    load_notes: Sequence[str] = ()  # what the user should know about what was loaded
    needs_features: bool = False  # whether accept() wants the target's hidden states
    prompt_features: int | None = None  # features wanted for the last N prompt tokens
    drafts_ahead: bool = False  # whether the engine should call draft_ahead (overlap)
    is_draft_model: bool = False  # drafting costs real time (a head or a draft LM)

    @abstractmethod
    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        """Start a generation. ``context`` is the prompt plus the first sampled token;
        ``features`` (when needed) are the target's hidden states of the evaluated
        prompt tokens."""

    @abstractmethod
    def draft(self, max_tokens: int, token_time_s: float) -> DraftTree:
        """Propose at most ``max_tokens`` tokens to follow the context. ``token_time_s``
        is the target's time for one plain token at this context: what an accepted draft
        token saves, against what drafting it costs. A tree made by ``draft_ahead`` comes
        back with ``made_ahead`` set."""

    @abstractmethod
    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        """The target committed: ``new_tokens`` were appended to the context (accepted
        drafts, then the target's own next token); ``features`` are the target's hidden
        states of the tokens just evaluated and kept (root and accepted drafts)."""

    def verifying(self, tree: DraftTree) -> None:  # noqa: B027
        """The target is about to verify ``tree``: what the budget kept of the last draft
        (a drafter that reports its verified tokens, as a prediction's, counts them)."""

    def draft_ahead(self, verifying: DraftTree, max_tokens: int,  # noqa: B027
                    token_time_s: float) -> None:
        """Called in a worker thread while the target verifies ``verifying`` (and before
        ``accept``): prepare the next draft, to be served by ``draft`` if the target's
        new tokens turn out as guessed. It must touch only the drafter's own state."""

    def finish(self, tokens: list[int]) -> None:  # noqa: B027
        """The generation ended; ``tokens`` are its prompt and answer (a drafter with
        memory keeps them for later generations)."""

    def pin(self) -> None:  # noqa: B027
        """Stop following this machine's timings (a head's dynamic depth), so the same
        context drafts the same tokens on any run (a replayed test case)."""

    def stats(self) -> dict[str, float]:
        """Drafter-specific counters for the dashboard."""
        return {}

    def set_threads(self, n_threads: int) -> None:  # noqa: B027
        """Draft with ``n_threads`` CPU threads from the next answer on (llama.cpp
        drafters; the others keep theirs)."""

    def close(self) -> None:  # noqa: B027
        """Free what the drafter holds outside Python (a draft model's context)."""
