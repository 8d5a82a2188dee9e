"""Reading a prompt into the target's sequence 0: the room for everything a prompt takes
that a verification does not.

- The **F16 context** (``engine.runtime.f16_prefill``): long prompts are prefilled in a
  second context with an F16/F16 cache, with a prefill copy of the weights where that
  pays, and their cells moved into the target's Q8_0 cache after the first token is out.
- **Remembered prefills**: a prompt asked again whole (a regenerate) gets its first
  token's logits again instead of a decode of its last token alone.
- The **context shift**: a prompt that is the cached tokens with a span cut out keeps the
  cells after the cut, shifted back over it.

``Target`` (verification, decoding) calls ``read`` to prefill. Both change sequence 0
through its owner, ``engine.runtime.sequence.CachedSequence``: a prompt's cells may still
sit in the F16 context after ``read`` returns (a pending move); they move when the
sequence next settles. Figures behind the thresholds:
docs/benchmarks.md ("Reading prompts").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import ContextFullError, InvalidPromptError
from engine.runtime.f16_prefill import F16Prefill, fast_prompts
from engine.runtime.sequences import common_prefix_length, find_cut

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.runtime.architecture import ArchitectureFacts
    from engine.runtime.native import NativeBatch, NativeModel
    from engine.runtime.sequence import CachedSequence
    from engine.runtime.target_config import TargetConfig

log = logging.getLogger(__name__)

# Prompts whose first-token logits are kept for a regenerate: a chat's last few turns.
REMEMBERED_PREFILLS = 4
# Fewest cached tokens after a cut (a chat's dropped turns) worth shifting rather than
# prefilling again: the shift costs a one-token decode and a copy of the sequence.
SHIFT_MIN_KEPT = 64

# A remembered prefill: the prompt's tokens, its last token's logits and the features.
Remembered = tuple[tuple[int, ...], np.ndarray, np.ndarray | None]


@dataclass
class Prefill:
    logits: np.ndarray  # [n_vocab] for the token after the prompt
    features: np.ndarray | None  # [n, feature_width] for the last n prompt tokens evaluated
    n_reused: int  # prompt tokens found already in the cache


class PromptReader:
    """The prompt machinery of one target (see the module docstring)."""

    def __init__(self, model: NativeModel, path: Path, arch: ArchitectureFacts,
                 config: TargetConfig, sequence: CachedSequence, batch: NativeBatch,
                 n_threads: int, n_gpu_layers: int) -> None:
        """Reads prompts of ``model`` (at ``path``, ``config``'s settings) into
        ``sequence``, whose decoding batch it shares. Opens the F16 context where it
        applies: made now, not on the first long prompt, whose first token would wait
        for it (docs/benchmarks.md: figures behind the code's rules, "Reading prompts")."""
        self.model, self.path, self.arch, self.config = model, path, arch, config
        self.sequence, self.batch = sequence, batch
        self.n_gpu_layers = n_gpu_layers
        sequence.on_cells_changed(self._forget_beyond)
        # Newest first; only prompts whose cells are still the ones evaluated.
        self.remembered: list[Remembered] = []
        self.f16 = F16Prefill(model, path, arch, config, sequence, batch, n_threads,
                              n_gpu_layers)

    def close(self) -> None:
        self.f16.close()

    @property
    def f16_off(self) -> str | None:
        """Why long prompts are not prefilled in the F16 context, None when they are."""
        return self.f16.off

    def set_threads(self, n_threads: int) -> None:
        self.f16.set_threads(n_threads)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        self.f16.set_feature_layers(layers)

    def set_next_features(self, on: bool) -> None:
        self.f16.set_next_features(on)

    # --- what the target tells it ----------------------------------------------------
    @property
    def fast_prompts(self) -> bool:
        """Whether prompts are read with the prompt kernels (asked for, and built in)."""
        return fast_prompts(self.config)

    @property
    def n_ctx(self) -> int:
        return self.sequence.ctx.n_ctx

    def _forget_beyond(self, n_keep: int) -> None:
        """Sequence 0 keeps only its first ``n_keep`` tokens' cells as evaluated: a
        prompt longer than that lost cells, so its remembered logits are stale."""
        self.remembered = [e for e in self.remembered if len(e[0]) <= n_keep]

    def forget_all(self, cold: bool = False) -> None:
        """No remembered prefill holds; ``cold`` empties the F16 context too."""
        self.remembered = []
        if cold:
            self.f16.clear()

    def remembered_restorer(self) -> Callable[[], None]:
        """Puts the remembered prefills back as they are now (the cache put back byte for
        byte after a measurement: ``Target.cache_kept``)."""
        held = list(self.remembered)

        def restore() -> None:
            self.remembered = held
        return restore

    # --- reading a prompt --------------------------------------------------------------
    def read(self, prompt: list[int], feature_tail: int | None) -> Prefill:
        """``Target.prefill``: evaluate ``prompt`` into sequence 0, reusing the cached
        common prefix (see there)."""
        seq, n_vocab = self.sequence, self.model.n_vocab
        if not prompt:
            raise InvalidPromptError("the prompt is empty")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= n_vocab:
            bad = low if low < 0 else high
            raise InvalidPromptError(f"the prompt holds token id {bad}, outside this model's "
                                     f"vocabulary (0 to {n_vocab - 1})")
        if len(prompt) + 1 > self.n_ctx:
            raise ContextFullError(len(prompt) + 1, self.n_ctx)
        seq.unpark()  # (the last prompt's cells settle first, before any of this one's)
        n_same = common_prefix_length(seq.tokens, prompt)
        if n_same < seq.n_past:
            n_same = self._keep_across_a_cut(prompt, n_same)
        n_same = self._within_the_window(n_same, len(prompt))
        again = self._answer_again(prompt, n_same, feature_tail)
        if again is not None:
            return again
        # Evaluate at least the last prompt token: its logits choose the first new token.
        n_keep = min(n_same, len(prompt) - 1)
        seq.truncate(n_keep, for_a_prompt=True)
        todo = prompt[n_keep:]
        ctx = seq.ctx
        with_features = ctx.features_on
        tail = 1  # the last token's logits choose the first new token
        if with_features:
            tail = len(todo) if feature_tail is None else max(1, min(feature_tail, len(todo)))
        # A long prompt is evaluated in the F16 context, its cells moved here; the last
        # token's logits come from there too, as llama-server's do (a decode of that token
        # alone here cost a full token's time). What the drafter asks of features changes
        # neither the cells nor those logits.
        moved = self.f16.prefill(todo, n_features=tail if with_features else 0)
        if moved is not None:
            logits, features = moved
            kept = features if with_features else None
            self._remember(prompt, logits, kept)
            return Prefill(logits=logits, features=kept, n_reused=n_keep)
        fast = self.fast_prompts
        # Recurrent state asked again whole (a regenerate) goes back to the prompt's
        # checkpoint, after its last token: that token's logits are kept for it.
        keep = fast or self.arch.has_state
        if with_features and (self.config.max_batch is not None or fast):
            # Kernels exact only in short batches (repacked K-quants), or the prompt
            # kernels: the prompt goes in plain decoding's chunks and kernels, so its
            # cells and the first token's logits are plain decoding's; the features come
            # from evaluating the tail again.
            ctx.set_features(False)
            try:
                logits, _ = seq.evaluate_prompt(todo)
            finally:
                ctx.set_features(True)
            feats = seq.features_again(self._room_for(tail))
            if keep:
                self._remember(prompt, logits, feats)
            return Prefill(logits=logits, features=feats, n_reused=n_keep)
        if not with_features:
            logits, _ = seq.evaluate_prompt(todo)
            if keep:
                self._remember(prompt, logits, None)
            return Prefill(logits=logits, features=None, n_reused=n_keep)
        # Exact kernels for any batch: the features' tail may be a chunk of its own.
        if tail < len(todo):
            ctx.set_features(False)
            try:
                seq.evaluate(todo[:-tail], self.config.n_batch)
            finally:
                ctx.set_features(True)
            todo = todo[-tail:]
        logits, tail_feats = seq.evaluate(todo, self.config.n_batch)
        features = np.concatenate(tail_feats) if tail_feats else None
        if keep:
            self._remember(prompt, logits, features)
        return Prefill(logits=logits, features=features, n_reused=n_keep)

    # --- remembered prefills -------------------------------------------------------------
    def _answer_again(self, prompt: list[int], n_same: int, feature_tail: int | None
                      ) -> Prefill | None:
        """The prefill of a prompt asked again whole (a regenerate) whose last token's
        logits came from the F16 context or the prompt kernels: those logits again, not a
        decode of that token alone, which reads the Q8_0 cache or sums otherwise and can
        pick another first token. None when it does not apply."""
        seq = self.sequence
        key = tuple(prompt)
        last = next((e for e in self.remembered if e[0] == key), None)
        if last is None or n_same < len(prompt):
            return None
        if self.arch.has_state and not seq.has_checkpoint_at(len(prompt)):
            return None  # the state read again would not be the one these logits saw
        seq.truncate(len(prompt), for_a_prompt=True)
        features = None
        if seq.ctx.features_on:
            want = 1 if feature_tail is None else max(1, min(feature_tail, len(prompt)))
            kept = last[2]
            # Fewer kept than asked (a short prompt read in the target's own cache kept
            # as many as it evaluated): evaluated again beside the prompt. Never a
            # decode of the last token alone, whose logits would not be plain's.
            features = kept[-want:] if kept is not None and len(kept) >= want \
                else seq.features_again(self._room_for(want))
        return Prefill(logits=last[1].copy(), features=features, n_reused=len(prompt))

    def _room_for(self, n_features: int) -> int:
        """Features evaluated again take cells of their own (a scratch sequence) until
        they are read: at most as many as the context has free, at least the last
        token's (a prompt always leaves one cell free). Near the context's end a drafter
        gets fewer features rather than an error plain decoding would not raise."""
        return max(1, min(n_features, self.n_ctx - self.sequence.n_used))

    def _remember(self, prompt: list[int], logits: np.ndarray,
                  features: np.ndarray | None) -> None:
        key = tuple(prompt)
        rest = [e for e in self.remembered if e[0] != key]
        self.remembered = [(key, logits, features)] + rest[:REMEMBERED_PREFILLS - 1]

    # --- the context shift ---------------------------------------------------------------
    def _within_the_window(self, n_same: int, n_prompt: int) -> int:
        """How much of the cached prefix a sliding-window model can go on from: all of it
        when the window cache holds the window before its end (moved again from the F16
        context into a hole a move left), else nothing (as llama-server does without a
        checkpoint). The window cache keeps only the last window of a prompt moved in
        from the F16 context (one sequence's state leaves older cells out), and
        llama.cpp drops older positions when it reuses cells that left the window; a
        prompt going on from further back would attend to cells that are not there
        (gemma3 after a long prompt, a new chat sharing its first 20 tokens: 4.8 apart
        from reading it afresh)."""
        n_swa = self.arch.n_swa
        if not n_swa or n_same == 0:
            return n_same
        # The first token read (at least the prompt's last, where remembered logits do
        # not serve) attends back to position first - n_swa + 1 in the window's layers.
        first = min(n_same, n_prompt - 1)
        needed_from = max(0, first - n_swa + 1)
        gap = self.sequence.window_gap
        # A window that reaches into the hole a move left (a prompt going on from inside
        # the moved span: an edit after a long prompt; gemma3, the differential: llama.cpp
        # refused the batch, the window cache ending 120 positions before it): the
        # window before ``first`` is moved again from the F16 context where it still
        # holds it, else the prompt is read afresh.
        if gap is not None and first > gap[0] and needed_from < gap[1]:
            lo = max(needed_from, gap[0])
            # The cells moved again are the ones moved before (the F16 context reads a
            # prompt in the same chunks whatever it held), so prefills remembered up to
            # them still hold (a regenerate's first token).
            keep = self.remembered_restorer()
            if not self.sequence.fill_window(lo, n_same, self.f16):
                return 0
            keep()
            self._forget_beyond(n_same)
            log.info("a prompt going back into the window cache's hole: positions [%d, %d) "
                     "moved again", lo, n_same)
        # The window cache's lowest position (llama-kv-cache-iswa.cpp)
        lowest = self.sequence.settled().kv_pos_min(0)
        return n_same if 0 <= lowest <= needed_from else 0

    def _keep_across_a_cut(self, prompt: list[int], n_same: int) -> int:
        """A prompt that is the cached tokens with a span cut out after the common prefix
        (a long chat's oldest turns dropped) keeps the cells after the cut: they are
        shifted back over it, as llama.cpp's context shift does
        (``CachedSequence.shift_out``), instead of prefilled again. K is rotated to its
        new positions (a quantized K through F32, so its numbers change: later answers
        equal plain decoding's from this same cache, not a fresh prefill's). Returns how
        many prompt tokens the cache now holds."""
        seq = self.sequence
        if self.arch.has_state or not seq.ctx.can_shift:
            return n_same
        cut = find_cut(seq.tokens, prompt, n_same, SHIFT_MIN_KEPT)
        if cut is None:
            return n_same
        n_cut, n_kept = cut
        if not seq.shift_out(n_same, n_cut, n_kept):
            return 0
        log.info("context shift: %d tokens cut after %d, %d kept", n_cut, n_same, n_kept)
        return n_same + n_kept

