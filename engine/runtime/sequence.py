"""Sequence 0 of a target's decoding context, with one owner: the tokens its cells hold,
the cells a drafted answer parked, recurrent-state checkpoints
(``engine.runtime.state_checkpoints``), the cells of a long prompt still waiting in the
F16 context (a pending move) and the hole a move left in a sliding-window model's window
cache (``engine.runtime.window_gap``).

Bit-exactness and cell order: llama.cpp's attention sums over KV cells in cell order, so
sequence 0's cells must stay in position order, as in plain decoding, or logits drift by
rounding and greedy near-ties flip. A tree's rejected nodes that sit *before* an accepted
node would leave holes that later tokens fill out of order; those cells are parked in a
sequence nobody attends to (``park_seq``) instead of being freed. Rejected nodes after
the last accepted one are freed: later tokens refill them in order.

A pending move settles inside this class, before any of its methods reads or writes a
cell; code that decodes into the context itself (verification) asks for ``settled()``.
``Target`` (verification, decoding) and ``PromptReader`` (prompts) change sequence 0
only through the methods here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.errors import NativeError
from engine.runtime.kv_transfer import StateFormatError
from engine.runtime.native import NativeBatch, NativeContext, prompt_kernels
from engine.runtime.state_checkpoints import StateCheckpoints
from engine.runtime.window_gap import WindowGap

if TYPE_CHECKING:
    from engine.runtime.architecture import ArchitectureFacts

log = logging.getLogger(__name__)


class PendingMove(Protocol):
    """Where a prompt's cells wait before they join sequence 0 (the F16 context)."""

    def cells_from(self, start: int, end: int) -> np.ndarray:
        """Sequence 0's cells of positions [start, end), as a state blob this context
        reads. Raises NativeError or StateFormatError."""
        ...

    def holds(self, tokens: list[int]) -> bool:
        """Whether its cells for ``tokens`` (from position 0) are still there."""
        ...

    def move_failed(self, exc: Exception) -> None:
        """The move failed (the cells are evaluated here instead)."""
        ...


class CachedSequence:
    """Sequence 0 and its books (see the module docstring)."""

    def __init__(self, ctx: NativeContext, batch: NativeBatch, arch: ArchitectureFacts,
                 n_batch: int, prompt_kernels_on: bool) -> None:
        self._ctx, self._batch, self._arch = ctx, batch, arch
        self._n_batch, self._prompt_kernels = n_batch, prompt_kernels_on
        self._tokens: list[int] = []
        self.park_seq = batch.n_seq_max - 1
        self._n_parked = 0
        self._parked_from = 0  # every parked cell sits at a position >= this
        self._checkpoints = StateCheckpoints()  # recurrent state as the last prompts left it
        # The positions [start, end) whose cells still wait, and where they wait.
        self._pending: tuple[int, int, PendingMove] | None = None
        self._window_gap = WindowGap()  # (engine.runtime.window_gap)
        # Told the first position whose cells are no longer the ones evaluated (the
        # prompt reader's remembered prefills hold only while theirs are).
        self._listeners: list[Callable[[int], None]] = []
        # Tokens evaluated again because recurrent state could not go back to where a
        # prompt parted (a count to watch: no path should read a conversation again).
        self.n_read_again = 0

    # --- facts -------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The tokens sequence 0 holds, in position order (read it; never write it)."""
        return self._tokens

    @property
    def n_past(self) -> int:
        return len(self._tokens)

    @property
    def n_parked(self) -> int:
        return self._n_parked

    @property
    def n_used(self) -> int:
        """KV cells taken: the committed tokens and the parked cells."""
        return len(self._tokens) + self._n_parked

    @property
    def ctx(self) -> NativeContext:
        """The context, for its flags and outputs; cells through ``settled``."""
        return self._ctx

    @property
    def window_gap(self) -> tuple[int, int] | None:
        """Positions [a, b) the window cache lacks (engine.runtime.window_gap)."""
        return self._window_gap.span

    def on_cells_changed(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(n)`` whenever the cells from position ``n`` on stop being the
        ones evaluated there (taken back, shifted, emptied)."""
        self._listeners.append(listener)

    def _cells_changed(self, n_keep: int) -> None:
        for listener in self._listeners:
            listener(n_keep)

    def has_checkpoint_at(self, n_tokens: int) -> bool:
        return self._checkpoints.at(n_tokens)

    # --- settling ----------------------------------------------------------------------
    def settled(self) -> NativeContext:
        """The context with every cell of sequence 0 in it (a pending move made now)."""
        if self._pending is not None:
            self._move_in()
        return self._ctx

    def append_pending(self, tokens: list[int], where: PendingMove) -> None:
        """``tokens`` join sequence 0 now; their cells come from ``where`` on the next
        settle, so the first token does not wait for the move."""
        self.settled()
        start = len(self._tokens)
        self._tokens.extend(tokens)
        self._pending = (start, len(self._tokens), where)

    def _move_in(self) -> None:
        assert self._pending is not None
        (start, end, where), self._pending = self._pending, None
        if not self._take_cells(start, end, where):
            redo = self._tokens[start:]
            del self._tokens[start:]
            self.evaluate_cells_only(redo)

    def _take_cells(self, start: int, end: int, where: PendingMove, whole: bool = False
                    ) -> bool:
        """Sequence 0's cells of positions [start, end) from ``where`` (through sequence
        1, free outside a verification). ``whole``: the window cache must get all of
        them. False when that failed (``where`` is told; nothing from ``start`` on is
        left)."""
        ctx = self._ctx
        try:
            ctx.state_seq_set(1, where.cells_from(start, end))
            if self._arch.n_swa:
                window_start = ctx.kv_pos_min(1)
                if whole and window_start != start:
                    raise StateFormatError(f"the window cache took the cells from position "
                                           f"{window_start}, not {start}")
                self._window_gap.moved(start, window_start)
            ctx.kv_copy(1, 0, -1, -1)
            return True
        except (NativeError, StateFormatError) as exc:
            ctx.kv_remove(0, start, -1)
            where.move_failed(exc)
            return False
        finally:
            ctx.kv_remove(1, -1, -1)

    def fill_window(self, lo: int, hi: int, where: PendingMove) -> bool:
        """Sequence 0 cut to its first ``hi`` tokens, the window cache holding [lo, hi)
        (a hole a move left): those cells moved again from ``where`` (at most a window,
        so one sequence's state leaves none out), in position order after the cells
        kept. False when ``where`` no longer holds them (nothing changed) or the move
        failed (the sequence is then cut to the hole's start)."""
        gap = self._window_gap.span
        if gap is None or not gap[0] <= lo < hi <= min(len(self._tokens), lo + self._arch.n_swa):
            return False
        if not where.holds(self._tokens[:hi]):
            return False
        tokens = self._tokens[lo:hi]
        self.truncate(lo)
        if not self._take_cells(lo, hi, where, whole=True):
            self.truncate(gap[0])  # (which ends the hole)
            return False
        self._tokens.extend(tokens)
        self._window_gap.refilled_from(lo)
        return True

    # --- appending ---------------------------------------------------------------------
    def append_decoded(self, tokens: list[int]) -> None:
        """``tokens`` were just decoded into sequence 0's next positions."""
        self._tokens.extend(tokens)

    def evaluate(self, tokens: list[int], chunk_size: int
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Append ``tokens`` in chunks. Returns the last token's logits and, in features
        mode, every token's features; rolls back on a failed decode."""
        ctx = self.settled()
        n_keep = self.n_past
        feats: list[np.ndarray] = []
        logits = None
        try:
            for start in range(0, len(tokens), chunk_size):
                chunk = tokens[start:start + chunk_size]
                last_chunk = start + len(chunk) == len(tokens)
                pos0 = n_keep + start
                # In features mode every token is an output (llama.cpp's embeddings
                # mode makes them so anyway).
                outputs = [ctx.features_on] * len(chunk)
                outputs[-1] = last_chunk or ctx.features_on
                self._batch.fill(chunk, list(range(pos0, pos0 + len(chunk))), None, outputs)
                ctx.decode(self._batch)
                self._tokens.extend(chunk)
                n_out = len(chunk) if ctx.features_on else int(last_chunk)
                if ctx.features_on:
                    feats.append(ctx.features(n_out))
                if last_chunk:
                    logits = ctx.logits(n_out)[n_out - 1]
        except BaseException:
            self.truncate(n_keep)
            raise
        assert logits is not None
        return logits, feats

    def evaluate_prompt(self, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """``evaluate`` in prefill chunks with the prompt kernels where they are on:
        plain and drafted answers share the prefill, so its sums may be a batch's."""
        with prompt_kernels(self._prompt_kernels):
            return self.evaluate(tokens, self._n_batch)

    def evaluate_cells_only(self, tokens: list[int]) -> None:
        """Append ``tokens`` for their cells (or state) alone: no hidden states asked."""
        features = self._ctx.features_on
        self._ctx.set_features(False)
        try:
            self.evaluate_prompt(tokens)
        finally:
            self._ctx.set_features(features)

    def features_again(self, n: int) -> np.ndarray:
        """The hidden states of the last ``n`` tokens, evaluated again in a scratch
        sequence over the cells before them; sequence 0 is left as it was."""
        ctx = self.settled()
        scratch = 1  # a tree's sequence: free between verifications
        start = self.n_past - n
        ctx.kv_remove(scratch, -1, -1)
        ctx.kv_copy(0, scratch, 0, start)
        feats = []
        try:
            for at in range(start, self.n_past, self._n_batch):
                end = min(at + self._n_batch, self.n_past)
                self._batch.fill(self._tokens[at:end], list(range(at, end)),
                                 [(scratch,)] * (end - at), True)
                ctx.decode(self._batch)
                feats.append(np.array(ctx.features(end - at), copy=True))
        finally:
            ctx.kv_remove(scratch, -1, -1)
        return np.concatenate(feats)

    # --- a verification's cells ----------------------------------------------------------
    def drop_uncommitted(self) -> None:
        """Remove cells past the committed tokens (a failed decode's)."""
        self._ctx.kv_remove(0, self.n_past, -1)

    def park(self, from_seq: int, pos: int) -> None:
        """Keep the cell at ``pos`` of ``from_seq`` out of every sequence's attention: a
        rejected node that precedes an accepted one."""
        self._ctx.kv_copy(from_seq, self.park_seq, pos, pos + 1)
        if not self._n_parked:
            self._parked_from = self.n_past + 1
        self._n_parked += 1

    def keep_path(self, from_seq: int, n_keep: int, path_tokens: list[int]) -> bool:
        """Sequence 0 ends with the verified path from ``from_seq`` (its cells up to
        position ``n_keep``) and holds ``path_tokens`` more. False (nothing changed) when
        recurrent state cannot take back what follows the path."""
        ctx, base = self._ctx, self.n_past
        if from_seq == 0:
            if not ctx.kv_remove(0, n_keep, -1):
                return False
        else:  # the path sits in another leaf's sequence: moved into sequence 0
            ctx.kv_remove(0, base + 1, -1)
            ctx.kv_copy(from_seq, 0, base + 1, n_keep)
        self._tokens.extend(path_tokens)
        return True

    # --- taking back ---------------------------------------------------------------------
    def truncate(self, n_keep: int, for_a_prompt: bool = False) -> None:
        """Forget everything after the first ``n_keep`` tokens. ``for_a_prompt``: a new
        prompt parts there, and recurrent state goes back from a checkpoint, never through
        its snapshots, whose sums plain decoding's are not (lfm2: 2.7e-5 apart)."""
        self._cells_changed(n_keep)
        self._window_gap.cut(n_keep)
        self._checkpoints.cut(n_keep)
        if n_keep < len(self._tokens):
            ctx = self.settled()
            if for_a_prompt and self._arch.has_state:
                self.from_checkpoint(n_keep)
            else:
                if not ctx.kv_remove(0, n_keep, -1):  # state further back than its snapshots
                    self.from_checkpoint(n_keep)
                del self._tokens[n_keep:]
        if self._n_parked and n_keep <= self._parked_from:
            # Every parked cell now follows every kept cell: freeing them leaves no hole.
            self._ctx.kv_remove(self.park_seq, -1, -1)
            self._n_parked = 0

    def clear(self) -> None:
        """Empty the cache (cells never moved in need no clearing)."""
        self._pending = None
        self._window_gap = WindowGap()
        self._ctx.kv_clear()
        self._tokens = []
        self._checkpoints = StateCheckpoints()
        self._n_parked = 0
        self._cells_changed(0)

    def compact(self, chunk: int) -> None:
        """Free the parked cells by evaluating the tokens committed since the first of
        them again, in batches of ``chunk`` (where verification's kernels are exact), so
        the cache holds the same values. For when the context runs short."""
        if not self._n_parked:
            return
        start = self._parked_from
        redo = self._tokens[start:]
        self.truncate(start)
        self.evaluate(redo, chunk)

    def unpark(self) -> None:
        """Before a prompt: free the parked cells and write the sequence back from the
        start, so its cells are where plain decoding's are, in position order. Freed in
        place, they would leave holes the prompt's cells fill, and its sums differ (F32,
        tests/cases: 0.36 apart after a long follow-up). The values are copied, not
        evaluated again."""
        ctx = self.settled()
        if not self._n_parked:
            return
        ctx.kv_remove(self.park_seq, -1, -1)
        self._n_parked = 0
        if not self._arch.has_state:  # no trees, so nothing parked; never rewrite state
            self._write_back()

    def _write_back(self) -> None:
        """Sequence 0's cells written back from the start, in position order (a copy:
        ``kv_clear`` leaves the blob as it was). A sliding-window model's cache is written
        whole (sequence -1): one sequence's state leaves out the window cache's cells that
        have left the window, which a later prompt going back further needs (gemma3, the
        differential: 0.33 apart)."""
        seq = -1 if self._arch.n_swa else 0
        blob = self._ctx.state_seq_array(seq)
        self._ctx.kv_clear()
        self._ctx.state_seq_set(seq, blob)

    # --- the context shift ---------------------------------------------------------------
    def shift_out(self, n_same: int, n_cut: int, n_kept: int) -> bool:
        """Cut ``n_cut`` tokens after the first ``n_same`` and shift the ``n_kept`` after
        them back over the cut, as llama.cpp's context shift does; the rest is dropped,
        and the sequence written back from the start so its cells stay in position order.
        False when llama.cpp failed (the cache is then empty)."""
        end = n_same + n_cut + n_kept
        ctx = self.settled()
        self.unpark()
        ctx.kv_remove(0, end, -1)
        ctx.kv_remove(0, n_same, n_same + n_cut)
        ctx.kv_shift(0, n_same + n_cut, end, -n_cut)
        kept = self._tokens[:n_same] + self._tokens[n_same + n_cut:end]
        features = ctx.features_on
        try:
            # llama.cpp rotates K at the next decode: one token in a scratch sequence,
            # with no output, so no features either (an MTP block's next-token rows of
            # a batch without outputs crashed llama.cpp: deepseek2, the differential).
            ctx.set_features(False)
            self._batch.fill([kept[-1]], [len(kept)], [(1,)], [False])
            ctx.decode(self._batch)
            ctx.kv_remove(1, -1, -1)
            self._write_back()
        except NativeError as exc:
            log.warning("context shift failed, the prompt is prefilled again: %s", exc)
            self.clear()
            return False
        finally:
            ctx.set_features(features)
        self._tokens = kept
        self._cells_changed(0)  # the kept cells moved: no prompt's logits hold
        self._window_gap.shifted(n_same, n_cut, len(kept))
        return True

    # --- recurrent state -----------------------------------------------------------------
    def keep_checkpoint(self) -> None:
        """Remember recurrent state as the prompt just read left it
        (engine.runtime.state_checkpoints); nothing on models without recurrent state."""
        if self._arch.has_state and self._tokens:
            self._checkpoints.keep(self.settled(), len(self._tokens))

    def from_checkpoint(self, n_keep: int) -> None:
        """Sequence 0 as its first ``n_keep`` tokens where its recurrent state cannot go
        back that far: the last checkpoint's state at or before ``n_keep`` and the
        attention cells before it, the tokens between evaluated again; with no such
        checkpoint, the whole sequence evaluated again."""
        kept = self._tokens[:n_keep]
        at = self._checkpoints.restore(self._ctx, n_keep)
        if at is None:
            self.evaluate_again(kept)
            return
        self._tokens = kept[:at]
        if n_keep > at:
            self.n_read_again += n_keep - at
            self.evaluate_cells_only(kept[at:])

    def evaluate_again(self, kept: list[int]) -> None:
        """Rebuild sequence 0 as ``kept`` from an empty cache (recurrent state asked to go
        back further than its snapshots and checkpoints reach)."""
        kept = list(kept)
        self.clear()  # their cells are evaluated anew, maybe in other chunks
        self.n_read_again += len(kept)
        if kept:
            self.evaluate_cells_only(kept)

    # --- moving the whole sequence -------------------------------------------------------
    def move_to(self, fresh: NativeContext) -> None:
        """Go on in ``fresh`` (a context like this one, other settings): the parked cells
        freed, sequence 0's copied across (the old context is the caller's to close)."""
        ctx = self.settled()
        if self._n_parked:  # parked cells are a tree's: sequence 0 alone moves
            ctx.kv_remove(self.park_seq, -1, -1)
            self._n_parked = 0
        cells = ctx.state_seq_array(0) if self._tokens else None
        fresh.set_features(ctx.features_on)
        self._ctx = fresh
        if cells is not None:
            try:
                fresh.state_seq_set(0, cells)
            except NativeError:  # cells of a context like this one: not expected
                log.warning("the cache could not follow the new context: evaluated again")
                self.evaluate_again(self._tokens)

    @contextmanager
    def kept(self, on_restored: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Sequence 0 put back as it stood after a block that empties the cache: its
        cells copied out and in again byte for byte, as a plan switch moves them;
        ``on_restored`` is called once they are (not when they were evaluated again)."""
        ctx = self.settled()
        tokens, checkpoints = list(self._tokens), list(self._checkpoints.kept)
        cells = ctx.state_seq_array(0) if tokens else None
        try:
            yield
        finally:
            self.clear()
            if cells is not None:
                try:
                    self._ctx.state_seq_set(0, cells)
                    self._tokens = tokens
                    self._checkpoints = StateCheckpoints(checkpoints)
                    on_restored()
                except NativeError:  # a cache of the same types: not expected
                    log.warning("the cache could not be put back: evaluated again")
                    self.evaluate_again(tokens)
