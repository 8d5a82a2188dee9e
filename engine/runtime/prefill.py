"""Reading a prompt into the target's sequence 0: the room for everything a prompt takes
that a verification does not.

- The **F16 context**: long prompts are prefilled in a second context with an F16/F16
  cache (llama.cpp's tiled attention kernel), and their cells moved into the target's
  Q8_0 cache after the first token is out (``engine.runtime.kv_transfer`` says why).
- The **prefill copy**: where the target's own weight layout is the slower one for
  prompts, a second copy of the weights in the faster layout prefills there
  (``engine.runtime.prompt_weights``).
- The **move buffer** the cells travel through, made when the target opens.
- **Remembered prefills**: a prompt asked again whole (a regenerate) gets its first
  token's logits again instead of a decode of its last token alone.
- The **context shift**: a prompt that is the cached tokens with a span cut out keeps the
  cells after the cut, shifted back over it.

``Target`` keeps sequence 0 (evaluate, verify, commit, roll back) and calls ``read`` to
prefill. A prompt's cells may still sit in the F16 context after ``read`` returns; they
move on ``settle``, which the target calls before it decodes, copies or removes them.
Figures behind the thresholds: docs/benchmarks.md ("Reading prompts").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.errors import ContextFullError, InvalidPromptError, ModelLoadError, NativeError
from engine.gguf.header import read_file_facts
from engine.runtime.kv_cache import kv_bytes_per_token
from engine.runtime.kv_transfer import (
    StateFormatError,
    f16_to_q8_0_keys,
    llama_rotates_quantized_k,
)
from engine.runtime.native import (
    NativeContext,
    NativeModel,
    prompt_kernels,
    prompt_kernels_available,
)
from engine.runtime.prompt_weights import prompts_prefer_repacked
from engine.runtime.sequences import common_prefix_length, find_cut

if TYPE_CHECKING:
    from engine.runtime.architecture import ArchitectureFacts
    from engine.runtime.native import NativeBatch

log = logging.getLogger(__name__)

# Shortest run of prompt tokens worth prefilling in the F16 context: llama.cpp's tiled
# attention kernel needs 64 queries in a batch, and below ~100 tokens attention is too
# small a share of the prefill to repay moving the cells.
F16_PREFILL_MIN_TOKENS = 128
# With a copy of the weights in the faster prompt layout the F16 context is where the
# fast kernels are: below this few tokens the cell move is not repaid.
F16_COPY_MIN_TOKENS = 16
# At most 1/F16_MAX_REDO_SHARE of a prompt's new tokens may be tokens this cache holds
# but the F16 context would evaluate again; past that, prefilling here is sooner.
F16_MAX_REDO_SHARE = 4
# Prompts whose first-token logits are kept for a regenerate: a chat's last few turns.
REMEMBERED_PREFILLS = 4
# Fewest cached tokens after a cut (a chat's dropped turns) worth shifting rather than
# prefilling again: the shift costs a one-token decode and a copy of the sequence.
SHIFT_MIN_KEPT = 64
# The largest buffer a long prompt's cell move keeps for the next one (a 1.7B shape's
# ~800-token prompt is 100 MB); longer prompts' moves allocate theirs each time.
MOVE_BUFFER_KEPT = 256 * 2**20
# Prompt tokens the move's buffer is made for when the target opens (rag prompts are
# 660-790 tokens).
MOVE_PREFAULT_TOKENS = 1024

# A remembered prefill: the prompt's tokens, its last token's logits and the features.
Remembered = tuple[tuple[int, ...], np.ndarray, np.ndarray | None]


@dataclass
class Prefill:
    logits: np.ndarray  # [n_vocab] for the token after the prompt
    features: np.ndarray | None  # [n, feature_width] for the last n prompt tokens evaluated
    n_reused: int  # prompt tokens found already in the cache


class SequenceZero(Protocol):
    """What the reader asks of the target that owns it (``engine.runtime.target.Target``):
    its sequence 0 and the primitives that append to it or take it back."""

    ctx: NativeContext
    batch: NativeBatch
    model: NativeModel
    tokens: list[int]
    path: Path
    arch: ArchitectureFacts
    n_threads: int
    n_gpu_layers: int
    park_seq: int
    n_parked: int

    @property
    def config(self): ...  # noqa: ANN201 - the target's TargetConfig

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_past(self) -> int: ...

    @property
    def n_used(self) -> int: ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def feature_width(self) -> int: ...

    def settle(self) -> None: ...

    def rollback(self, n_keep: int, for_a_prompt: bool = False) -> None: ...

    def reset(self, cold: bool = False) -> None: ...

    def evaluate(self, tokens: list[int], chunk_size: int
                 ) -> tuple[np.ndarray, list[np.ndarray]]: ...

    def evaluate_prompt(self, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]: ...

    def evaluate_cells_only(self, tokens: list[int]) -> None: ...

    def features_again(self, n: int) -> np.ndarray: ...


class PromptReader:
    """The prompt machinery of one target (see the module docstring)."""

    def __init__(self, target: SequenceZero) -> None:
        """Opens the F16 context where it applies: made now, not on the first long prompt,
        whose first token would wait for it (docs/benchmarks.md: figures behind the
        code's rules, "Reading prompts")."""
        self.target = target
        self.f16_ctx: NativeContext | None = None
        self.f16_tokens: list[int] = []  # what the F16 context's sequence 0 holds
        self.prefill_model: NativeModel | None = None  # the prefill copy, if one is made
        # Newest first; only prompts whose cells are still the ones evaluated.
        self.remembered: list[Remembered] = []
        # The first position whose cells are still in the F16 context, None when all are
        # in the target's cache.
        self.unmoved_from: int | None = None
        # Positions [a, b) of sequence 0 that a sliding-window model's window cache lacks:
        # a move from the F16 context brings only the last window of the moved cells, so
        # cells kept from before the move and the moved window have a hole between them.
        self.window_gap: tuple[int, int] | None = None
        self.move_buffer: np.ndarray | None = None
        self.f16_off = self._why_no_f16_prefill()
        if self.f16_off:
            return
        try:
            self.f16_ctx = NativeContext(
                self._open_prefill_model(), n_ctx=target.n_ctx,
                n_batch=target.config.n_batch, n_seq_max=2, n_threads=target.n_threads,
                features=False, type_k="f16", type_v="f16",
                # V laid out as the target's (transposed without flash attention)
                flash_attn=target.ctx.flash_attn)
        except ModelLoadError as exc:
            self.f16_off = f"no memory for it: {exc}"
            log.warning("F16 prefill off, prompts are prefilled in the Q8_0 cache: %s", exc)
        else:
            try:
                self._prefault_move_buffer()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        self.unmoved_from = None  # nothing left to move into a closing context
        for handle in (self.f16_ctx, self.prefill_model):
            if handle is not None:
                handle.close()
        self.f16_ctx = self.prefill_model = None

    # --- what the target tells it ----------------------------------------------------
    @property
    def fast_prompts(self) -> bool:
        """Whether prompts are read with the prompt kernels (asked for, and built in)."""
        return self.target.config.prompt_kernels and prompt_kernels_available()

    def settle(self) -> None:
        """Move the cells still in the F16 context into the target's cache now."""
        if self.unmoved_from is not None:
            self._move_cells()

    def drop_unmoved(self) -> None:
        """The target's cache is being emptied: cells never moved need no clearing, and
        the window cache has no hole."""
        self.unmoved_from = None
        self.window_gap = None

    def forget_beyond(self, n_keep: int) -> None:
        """The target keeps its first ``n_keep`` tokens: a prompt longer than that loses
        cells, so its remembered logits are stale (and a window cache's hole above them
        is gone)."""
        self.remembered = [e for e in self.remembered if len(e[0]) <= n_keep]
        if self.window_gap is not None and n_keep <= self.window_gap[0]:
            self.window_gap = None

    def forget_all(self, cold: bool = False) -> None:
        """No remembered prefill holds; ``cold`` empties the F16 context too."""
        self.remembered = []
        if cold and self.f16_ctx is not None:
            self.f16_ctx.kv_clear()
            self.f16_tokens = []

    def set_threads(self, n_threads: int) -> None:
        if self.f16_ctx is not None:
            self.f16_ctx.set_n_threads(n_threads)

    def set_feature_layers(self, layers: tuple[int, ...]) -> None:
        if self.f16_ctx is not None:
            self.f16_ctx.set_feature_layers(layers)

    def set_next_features(self, on: bool) -> None:
        if self.f16_ctx is not None:
            self.f16_ctx.set_next_features(on)

    # --- reading a prompt --------------------------------------------------------------
    def read(self, prompt: list[int], feature_tail: int | None) -> Prefill:
        """``Target.prefill``: evaluate ``prompt`` into sequence 0, reusing the cached
        common prefix (see there)."""
        t = self.target
        if not prompt:
            raise InvalidPromptError("the prompt is empty")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= t.n_vocab:
            bad = low if low < 0 else high
            raise InvalidPromptError(f"the prompt holds token id {bad}, outside this model's "
                                     f"vocabulary (0 to {t.n_vocab - 1})")
        if len(prompt) + 1 > t.n_ctx:
            raise ContextFullError(len(prompt) + 1, t.n_ctx)
        t.settle()  # the last prompt's cells, before any cell of this one
        if t.n_parked:
            self._unpark()
        n_same = common_prefix_length(t.tokens, prompt)
        if n_same < len(t.tokens):
            n_same = self._keep_across_a_cut(prompt, n_same)
        n_same = self._within_the_window(n_same, len(prompt))
        again = self._answer_again(prompt, n_same, feature_tail)
        if again is not None:
            return again
        # Evaluate at least the last prompt token: its logits choose the first new token.
        n_keep = min(n_same, len(prompt) - 1)
        t.rollback(n_keep, for_a_prompt=True)
        todo = prompt[n_keep:]
        with_features = t.ctx.features_on
        tail = 1  # the last token's logits choose the first new token
        if with_features:
            tail = len(todo) if feature_tail is None else max(1, min(feature_tail, len(todo)))
        # A long prompt is evaluated in the F16 context, its cells moved here; the last
        # token's logits come from there too, as llama-server's do (a decode of that token
        # alone here cost a full token's time). What the drafter asks of features changes
        # neither the cells nor those logits.
        moved = self._prefill_in_f16(todo, n_features=tail if with_features else 0)
        if moved is not None:
            logits, features = moved
            kept = features if with_features else None
            self._remember(prompt, logits, kept)
            return Prefill(logits=logits, features=kept, n_reused=n_keep)
        fast = self.fast_prompts
        # Recurrent state asked again whole (a regenerate) goes back to the prompt's
        # checkpoint, after its last token: that token's logits are kept for it.
        keep = fast or t.arch.has_state
        if with_features and (t.config.max_batch is not None or fast):
            # Kernels exact only in short batches (repacked K-quants), or the prompt
            # kernels: the prompt goes in plain decoding's chunks and kernels, so its
            # cells and the first token's logits are plain decoding's; the features come
            # from evaluating the tail again.
            t.ctx.set_features(False)
            try:
                logits, _ = t.evaluate_prompt(todo)
            finally:
                t.ctx.set_features(True)
            feats = t.features_again(self._room_for(tail))
            if keep:
                self._remember(prompt, logits, feats)
            return Prefill(logits=logits, features=feats, n_reused=n_keep)
        if not with_features:
            logits, _ = t.evaluate_prompt(todo)
            if keep:
                self._remember(prompt, logits, None)
            return Prefill(logits=logits, features=None, n_reused=n_keep)
        # Exact kernels for any batch: the features' tail may be a chunk of its own.
        if tail < len(todo):
            t.ctx.set_features(False)
            try:
                t.evaluate(todo[:-tail], t.config.n_batch)
            finally:
                t.ctx.set_features(True)
            todo = todo[-tail:]
        logits, tail_feats = t.evaluate(todo, t.config.n_batch)
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
        t = self.target
        key = tuple(prompt)
        last = next((e for e in self.remembered if e[0] == key), None)
        if last is None or n_same < len(prompt):
            return None
        if t.arch.has_state and not t.has_checkpoint_at(len(prompt)):
            return None  # the state read again would not be the one these logits saw
        t.rollback(len(prompt), for_a_prompt=True)
        features = None
        if t.ctx.features_on:
            want = 1 if feature_tail is None else max(1, min(feature_tail, len(prompt)))
            kept = last[2]
            # Fewer kept than asked (a short prompt read in the target's own cache kept
            # as many as it evaluated): evaluated again beside the prompt. Never a
            # decode of the last token alone, whose logits would not be plain's.
            features = kept[-want:] if kept is not None and len(kept) >= want \
                else t.features_again(self._room_for(want))
        return Prefill(logits=last[1].copy(), features=features, n_reused=len(prompt))

    def _room_for(self, n_features: int) -> int:
        """Features evaluated again take cells of their own (a scratch sequence) until
        they are read: at most as many as the context has free, at least the last
        token's (a prompt always leaves one cell free). Near the context's end a drafter
        gets fewer features rather than an error plain decoding would not raise."""
        t = self.target
        return max(1, min(n_features, t.n_ctx - t.n_used))

    def _remember(self, prompt: list[int], logits: np.ndarray,
                  features: np.ndarray | None) -> None:
        key = tuple(prompt)
        rest = [e for e in self.remembered if e[0] != key]
        self.remembered = [(key, logits, features)] + rest[:REMEMBERED_PREFILLS - 1]

    # --- the context shift ---------------------------------------------------------------
    def _within_the_window(self, n_same: int, n_prompt: int) -> int:
        """How much of the cached prefix a sliding-window model can go on from: all of it
        when the window cache holds the window before its end, else nothing (as
        llama-server does). The window cache keeps only the last window of a prompt
        moved in from the F16 context (one sequence's state leaves older cells out), and
        llama.cpp drops older positions when it reuses cells that left the window; a
        prompt going on from further back would attend to cells that are not there
        (gemma3 after a long prompt, a new chat sharing its first 20 tokens: 4.8 apart
        from reading it afresh)."""
        t = self.target
        if not t.arch.n_swa or n_same == 0:
            return n_same
        # The first token read (at least the prompt's last, where remembered logits do
        # not serve) attends back to position first - n_swa + 1 in the window's layers.
        first = min(n_same, n_prompt - 1)
        needed_from = max(0, first - t.arch.n_swa + 1)
        lowest = t.ctx.kv_pos_min(0)  # the window cache's (llama-kv-cache-iswa.cpp)
        gap = self.window_gap
        # A window that reaches into the hole a move left (a prompt going on from inside
        # the moved span: an edit after a long prompt; gemma3, the differential: llama.cpp
        # refused the batch, the window cache ending 120 positions before it).
        if gap is not None and first > gap[0] and needed_from < gap[1]:
            return 0
        return n_same if 0 <= lowest <= needed_from else 0

    def _unpark(self) -> None:
        """Before a prompt: free the cells a drafted answer parked, and write the sequence
        back from the start so its cells are where plain decoding's are, one after
        another in position order. Freed in place, they would leave holes between the
        answer's cells; the prompt's cells would then go elsewhere than in plain
        decoding's cache, and its sums differ (F32, tests/cases: 0.36 apart after a long
        follow-up). The values are copied, not evaluated again."""
        t = self.target
        t.ctx.kv_remove(t.park_seq, -1, -1)
        t.n_parked = 0
        if t.arch.has_state:  # no trees, so nothing parked; never rewrite recurrent state
            return
        self._write_back()

    def _write_back(self) -> None:
        """Sequence 0's cells written back from the start, one after another in position
        order (a copy: ``kv_clear`` leaves the blob as it was). A sliding-window model's
        cache is written whole (sequence -1): one sequence's state leaves out the window
        cache's cells that have left the window, and a later prompt that goes back
        further than the window needs them (gemma3, the differential: 0.33 apart)."""
        ctx = self.target.ctx
        seq = -1 if self.target.arch.n_swa else 0
        blob = ctx.state_seq_array(seq)
        ctx.kv_clear()
        ctx.state_seq_set(seq, blob)

    def _keep_across_a_cut(self, prompt: list[int], n_same: int) -> int:
        """A prompt that is the cached tokens with a span cut out after the common prefix
        (a long chat's oldest turns dropped) keeps the cells after the cut: they are
        shifted back over it, as llama.cpp's context shift does, instead of prefilled
        again. K is rotated to its new positions (a quantized K through F32, so its
        numbers change: later answers equal plain decoding's from this same cache, not a
        fresh prefill's). The sequence is then written back from the start so its cells
        stay in position order (engine.runtime.target's note): new tokens would otherwise
        fill the freed cells out of order. Returns how many prompt tokens the cache now
        holds."""
        t = self.target
        if t.arch.has_state or not t.ctx.can_shift:
            return n_same
        cut = find_cut(t.tokens, prompt, n_same, SHIFT_MIN_KEPT)
        if cut is None:
            return n_same
        n_cut, n_kept = cut
        end = n_same + n_cut + n_kept
        t.settle()
        ctx = t.ctx  # nothing is parked here: ``read`` unparked first
        ctx.kv_remove(0, end, -1)
        ctx.kv_remove(0, n_same, n_same + n_cut)
        ctx.kv_shift(0, n_same + n_cut, end, -n_cut)
        kept = t.tokens[:n_same] + t.tokens[n_same + n_cut:end]
        features = ctx.features_on
        try:
            # llama.cpp rotates K at the next decode: one token in a scratch sequence,
            # with no output, so no features either (an MTP block's next-token rows of
            # a batch without outputs crashed llama.cpp: deepseek2, the differential).
            ctx.set_features(False)
            t.batch.fill([kept[-1]], [len(kept)], [(1,)], [False])
            ctx.decode(t.batch)
            ctx.kv_remove(1, -1, -1)
            self._write_back()
        except NativeError as exc:
            log.warning("context shift failed, the prompt is prefilled again: %s", exc)
            t.reset()
            return 0
        finally:
            ctx.set_features(features)
        t.tokens = kept
        self.remembered = []  # the kept cells moved: no prompt's logits hold
        if self.window_gap is not None:  # the hole moved with the cells, or was cut out
            def shifted(p: int) -> int:
                return p if p <= n_same else max(n_same, p - n_cut)
            a, b = shifted(self.window_gap[0]), shifted(self.window_gap[1])
            self.window_gap = (a, b) if a < min(b, len(kept)) else None
        log.info("context shift: %d tokens cut after %d, %d kept", n_cut, n_same, n_kept)
        return n_same + n_kept

    # --- the F16 context (engine.runtime.kv_transfer) ------------------------------------
    def _why_no_f16_prefill(self) -> str | None:
        t = self.target
        c = t.config
        if not c.f16_prefill:
            return "turned off"
        if t.arch.why_no_cell_move:
            return t.arch.why_no_cell_move
        if c.type_k != "q8_0" or c.type_v != "f16":
            return f"the cache is {c.type_k}/{c.type_v}, not Q8_0/F16"
        if not c.unified_kv:
            return "needs one KV stream"
        if t.n_gpu_layers:
            return "layers run on a GPU"
        if c.workers:
            return "layers run on workers (the cell move would cross the network twice)"
        return None

    def _open_prefill_model(self) -> NativeModel:
        """The weights the F16 context prefills with: the target's own, or a copy in the
        layout its prompts prefill fastest with (``TargetConfig.prefill_copy``)."""
        t = self.target
        c = t.config
        if not c.prefill_copy:
            return t.model
        # Without the prompt kernels only repacking speeds a prompt up.
        repack = prompts_prefer_repacked(t.path) if self.fast_prompts else True
        if repack is None or repack == c.repack:
            return t.model
        if repack and not _room_for_a_copy(t.path):  # plain weights are mmapped
            return t.model
        try:
            self.prefill_model = NativeModel(t.path, repack=repack)
        except ModelLoadError as exc:
            log.warning("prompts are prefilled with the target's own weights: %s", exc)
            return t.model
        return self.prefill_model

    def _prefill_in_f16(self, tokens: list[int], n_features: int
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """Append ``tokens`` to sequence 0 by prefilling them in the F16 context and
        moving their cells here. Returns the last token's logits and the hidden states of
        the last ``n_features`` tokens ([0, n_embd] when none are asked), or None (nothing
        changed) when it does not apply or fails; a failure turns it off for this target,
        with a warning."""
        t = self.target
        shortest = (F16_COPY_MIN_TOKENS if self.prefill_model is not None
                    else F16_PREFILL_MIN_TOKENS)
        if self.f16_off or len(tokens) < shortest:
            return None
        # The F16 context holds the prompts it prefilled, not the answers decoded here:
        # a chat's next turn would evaluate the last answer there again.
        full = t.tokens + tokens
        start = self._f16_start(full)
        if (t.n_past - start) * F16_MAX_REDO_SHARE > len(tokens):
            return None
        try:
            return self._prefill_f16_and_move(full, start, n_features)
        except (NativeError, StateFormatError, ContextFullError) as exc:
            t.ctx.kv_remove(1, -1, -1)
            t.ctx.kv_remove(0, t.n_past, -1)
            self._turn_off_f16_prefill(exc)
            return None

    def _turn_off_f16_prefill(self, exc: Exception) -> None:
        self.f16_off = f"failed: {exc}"
        log.warning("F16 prefill off, prompts are prefilled in the Q8_0 cache: %s", exc)
        self.close()

    def _prefill_f16_and_move(self, full: list[int], start: int, n_features: int
                              ) -> tuple[np.ndarray, np.ndarray]:
        """Evaluate ``full`` (the committed tokens, then the new ones) from ``start`` in
        the F16 context; its new tokens become committed here, their cells moved later."""
        t = self.target
        # The last prompt's cells leave first; a failed move closes the F16 context, so
        # it is looked up after.
        self.settle()
        f16 = self.f16_ctx
        if f16 is None:  # made with the target; dropped only when turned off
            raise NativeError("F16 prefill context", 0, "closed")
        # Features are evaluated again beside the prompt (sequence 1): asked of sequence
        # 0's chunks they would make every token an output (the LM head over the whole
        # prompt) and change the last token's logits. The prompt leaves at least one cell
        # free, so at least the last token's fit.
        n_features = min(n_features, t.n_ctx - len(full))
        step = t.config.n_batch
        f16.kv_remove(0, start, -1)
        del self.f16_tokens[start:]
        with prompt_kernels(t.config.prompt_kernels):
            for pos0 in range(start, len(full), step):
                chunk = full[pos0:pos0 + step]
                outputs = [False] * len(chunk)
                outputs[-1] = pos0 + len(chunk) == len(full)
                t.batch.fill(chunk, list(range(pos0, pos0 + len(chunk))), None, outputs)
                f16.decode(t.batch)
                self.f16_tokens.extend(chunk)
            logits = f16.logits(1)[0]  # read back before the kernels change
        feats: np.ndarray | None = np.empty((0, t.feature_width), dtype=np.float32)
        if n_features > 0:
            try:
                feats = self._f16_features_again(f16, full, n_features)
            except (NativeError, ContextFullError) as exc:
                # The prompt was read as plain decoding reads it; only a drafter's
                # features failed. F16 prefill stays on: off in a drafted session alone,
                # its later prompts would be read otherwise than plain decoding's.
                log.warning("a prompt's features were not evaluated in the F16 context "
                            "(%s): evaluated over the moved cells", exc)
                feats = None
        # The cells move when the target next settles: the first token does not wait
        # for the copy and the K conversion.
        self.unmoved_from = t.n_past
        t.tokens.extend(full[t.n_past:])
        if feats is None:
            feats = self._features_over_moved_cells(n_features)
        return logits, feats

    def _features_over_moved_cells(self, n_features: int) -> np.ndarray:
        """The last ``n_features`` tokens' hidden states evaluated in the target's own
        cache (its cells moved first); none when that fails too (the drafter then
        drafts from fewer)."""
        t = self.target
        try:
            return t.features_again(n_features)
        except (NativeError, ContextFullError) as exc:
            log.warning("a prompt's features were not evaluated: %s", exc)
            return np.empty((0, t.feature_width), dtype=np.float32)

    def _f16_start(self, full: list[int]) -> int:
        """Where the F16 context's evaluation of ``full`` starts. Chunks start at
        multiples of n_batch, so the cells a prompt gets do not depend on which earlier
        prompt left how much in this context, nor on features asked. The last chunk is
        evaluated even when cached: its logits choose the first token."""
        step = self.target.config.n_batch
        n_same = common_prefix_length(self.f16_tokens, full)
        return min(n_same - n_same % step, (len(full) - 1) // step * step)

    def _f16_features_again(self, f16: NativeContext, full: list[int], n_features: int
                            ) -> np.ndarray:
        """Hidden states of the last ``n_features`` tokens of ``full`` (all in sequence
        0 of the F16 context), evaluated again in sequence 1 on sequence 0's cells
        before them; sequence 1 is emptied after."""
        batch = self.target.batch
        first = len(full) - n_features
        step = self.target.config.n_batch
        f16.kv_copy(0, 1, 0, first)  # shares the cells, copies nothing
        f16.set_features(True)
        try:
            feats = []
            for pos0 in range(first, len(full), step):
                chunk = full[pos0:pos0 + step]
                batch.fill(chunk, list(range(pos0, pos0 + len(chunk))),
                           [(1,)] * len(chunk), True)
                f16.decode(batch)
                feats.append(f16.features(len(chunk)))
            return np.concatenate(feats)
        finally:
            f16.set_features(False)
            f16.kv_remove(1, -1, -1)

    # --- the cell move ---------------------------------------------------------------------
    def _move_cells(self) -> None:
        """Move the cells from ``unmoved_from`` on out of the F16 context. If that fails,
        F16 prefill is turned off (with a warning) and those tokens are evaluated in the
        target's cache instead: the first token, already chosen, came from the F16
        prefill's logits."""
        t = self.target
        start, self.unmoved_from = self.unmoved_from, None
        assert start is not None and self.f16_ctx is not None
        f16 = self.f16_ctx
        try:
            # Sequence 1 is free outside a verification: the cells travel through it.
            f16.kv_copy(0, 1, start, -1)
            try:
                blob = f16.state_seq_array(1, into=self.move_buffer)
            finally:
                f16.kv_remove(1, -1, -1)
            self._keep_move_buffer(blob)
            moved = f16_to_q8_0_keys(blob, t.model.n_head_kv, llama_rotates_quantized_k())
            t.ctx.state_seq_set(1, moved)
            if t.arch.n_swa:
                self._note_window_gap(start, t.ctx.kv_pos_min(1))
            t.ctx.kv_copy(1, 0, -1, -1)
            t.ctx.kv_remove(1, -1, -1)
        except (NativeError, StateFormatError) as exc:
            t.ctx.kv_remove(1, -1, -1)
            t.ctx.kv_remove(0, start, -1)
            self._turn_off_f16_prefill(exc)
            redo = t.tokens[start:]
            del t.tokens[start:]
            t.evaluate_cells_only(redo)

    def _note_window_gap(self, start: int, window_start: int) -> None:
        """The window cache got the moved cells from ``window_start`` on (the moved
        window), not from ``start``: the positions between are a hole, merged with one
        left by an earlier move."""
        if window_start <= start:
            return
        gap = self.window_gap
        self.window_gap = (start, window_start) if gap is None else (
            min(gap[0], start), max(gap[1], window_start))

    def _prefault_move_buffer(self) -> None:
        """The move's buffer for a prompt of up to ``MOVE_PREFAULT_TOKENS`` tokens, its
        pages touched now, while the model opens: the first move in a process faulted it
        in before the answer's second token. Prompts of 16+ tokens take the move where
        weights are copied for prompts, so it is used at once."""
        t = self.target
        tokens = min(t.n_ctx, MOVE_PREFAULT_TOKENS)
        # A cell's K and V rows in F16, and its position and sequence (12 bytes).
        per_token = kv_bytes_per_token(read_file_facts(t.path), t.path.stat().st_size,
                                       "f16", "f16") + 12
        size = min(MOVE_BUFFER_KEPT, int(per_token * tokens) + 4096)
        buffer = np.empty(size, dtype=np.uint8)
        buffer[::4096] = 0
        self.move_buffer = buffer

    def _keep_move_buffer(self, blob: np.ndarray) -> None:
        """Keep the move's buffer for the next move, up to ``MOVE_BUFFER_KEPT`` bytes: a
        fresh one is faulted in page by page."""
        base = blob.base if isinstance(blob.base, np.ndarray) else blob
        if base.nbytes <= MOVE_BUFFER_KEPT and (self.move_buffer is None or
                                                 base.nbytes > self.move_buffer.nbytes):
            self.move_buffer = base


def _room_for_a_copy(path: Path) -> bool:
    """Whether the memory free now holds a second copy of the weights with a margin."""
    import psutil

    size = path.stat().st_size
    return psutil.virtual_memory().available > 2 * size + 1024**3
