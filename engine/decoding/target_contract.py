"""What ``generate`` (engine.decoding.generation) asks of a target, and nothing more.

Two targets answer it: ``engine.runtime.target.Target`` (the engine's own: sequence 0 of
its context, drafts verified as chains or trees) and ``engine.decoding.parallel.LaneTarget``
(one lane of several answers decoded together: the root alone, as a row of a shared
batch). Both satisfy ``DecodingTarget`` structurally: no base class, no registration, and
mypy checks each call of ``generate``.

The members come in three groups:

- **the model**: its vocabulary's reads and the facts a run's length depends on;
- **sequence of the answer**: the prompt read, a root (and its draft) verified, the
  accepted path committed, a plain greedy run, and taking back what plain decoding would
  not have evaluated;
- **what it can verify**: how far a draft may go (``trees``, ``max_draft``,
  ``max_leaves``), its parked cells (``n_parked``, ``compact``) and whether a greedy run
  stays in C (``greedy_in_c``). ``generate`` reads the draft limits only when a drafter
  drafts; a target that verifies the root alone says so in their values
  (``max_draft`` 0, ``trees`` False) and gives the reason in its docstrings.

The acceptance and sampling code ``generate`` calls (engine.decoding.acceptance,
engine.decoding.sampling, engine.decoding.logprobs) works on the logits alone: it asks
nothing of a target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:

    from engine.runtime.architecture import ArchitectureFacts
    from engine.runtime.draft_tree import DraftTree
    from engine.runtime.native import NativeModel
    from engine.runtime.prefill import Prefill
    from engine.runtime.target import Verification


class DecodingTarget(Protocol):
    """A target ``generate`` decodes on. Every member is read or called by
    engine.decoding.generation; tests/test_target_contract.py checks that ``Target`` and
    ``LaneTarget`` have each."""

    # --- the model -----------------------------------------------------------------------
    @property
    def model(self) -> NativeModel:
        """The loaded model: a grammar compiles over its vocabulary."""
        ...

    @property
    def arch(self) -> ArchitectureFacts:
        """The model's architecture: a plain greedy run is one token long where a stop
        string may end it and recurrent state (``has_state``) could not be taken back."""
        ...

    def is_end_of_generation(self, token: int, /) -> bool: ...

    def token_bytes(self, token: int, /) -> bytes: ...

    def tokenize(self, text: str, /, special: bool = ...) -> list[int]: ...

    # --- the answer's sequence -----------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """KV cells the answer's sequence may take."""
        ...

    @property
    def n_past(self) -> int:
        """Tokens committed: the prompt and the answer so far but its last token."""
        ...

    @property
    def n_used(self) -> int:
        """KV cells taken: ``n_past`` and the parked cells."""
        ...

    def set_features(self, on: bool, /) -> None:
        """Hidden states with every decode (for a draft head) or not."""
        ...

    def prefill(self, prompt: list[int], feature_tail: int | None = None, /) -> Prefill:
        """Read ``prompt`` (reusing what is cached); the logits after it. Raises
        ContextFullError when it cannot fit with room for one token."""
        ...

    def verify(self, root: int, draft: DraftTree, /) -> Verification:
        """Decode ``[root, *draft]`` in one batch; raises ContextFullError (nothing
        changed) when it does not fit."""
        ...

    def commit(self, verification: Verification, path: list[int],
               path_tokens: list[int], /) -> None:
        """Keep the accepted ``path`` (verification numbering, root first)."""
        ...

    def decode_greedy(self, token: int, n_max: int, /) -> tuple[list[int], list[float]]:
        """Plain greedy decoding of up to ``n_max`` tokens after ``token``: the tokens
        chosen (each but the last kept) and each choice's seconds."""
        ...

    def rollback(self, n_keep: int, /) -> None:
        """Keep the first ``n_keep`` tokens of the sequence only."""
        ...

    # --- what it can verify --------------------------------------------------------------
    @property
    def trees(self) -> bool:
        """Whether a draft tree can be verified (else chains only)."""
        ...

    @property
    def max_draft(self) -> int | None:
        """The longest draft one verification may hold; None for no limit."""
        ...

    @property
    def max_leaves(self) -> int:
        """The most leaves a verified tree may have (a sequence each)."""
        ...

    @property
    def n_parked(self) -> int:
        """KV cells of rejected draft tokens kept until ``compact``."""
        ...

    def compact(self) -> None:
        """Free the parked cells (for when the context runs short)."""
        ...

    @property
    def greedy_in_c(self) -> bool:
        """Whether ``decode_greedy`` runs in C (no Python between two decodes): else it
        decodes a token at a time and a run is one token long."""
        ...
