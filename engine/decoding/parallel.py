"""Several answers at once on one model: each in its own KV sequence of a shared context,
every answer's next token decoded in one batch.

On a CPU a batch of a few tokens costs little more than one (the weights are read once
for all rows), so answers decoded together finish sooner in all than one after another.

- **Each answer is exactly its answer alone.** Its prompt is read by the engine's own
  target, as for an answer alone. The prompt's cells are then moved bit for bit into the
  answer's sequence of the lanes' context. That context has the target's cache types,
  kernels and threads, and one KV stream per sequence, so a lane attends over its own cells
  in the order the target's sequence 0 holds them. Every token is then chosen by
  ``engine.decoding.generation.generate`` itself (sampling, grammar, stop strings, log
  probabilities), through a ``LaneTarget`` whose one-token decodes run as rows of a
  shared batch.
- **Batches stay exact only where verification is.** A row of a batch gets one-token
  decoding's logits when the model's kernels are batch-invariant, which is what the
  exactness probe checks (engine.planning.kernels). Where it failed, or kept verification
  to a few rows, the lanes are capped to match: one lane is plain decoding, one answer at
  a time.
- **No drafts in lanes.** Drafts and other answers would compete for the same rows of
  the same cores.

Every llama.cpp call runs on the thread that calls ``serve_forever`` (with OpenMP a
decode from another thread runs far slower); the answers' own loops run on their
threads, and each hands its decodes to that one. A thread that has other work too (the
desktop app's engine thread, which also answers the chat) calls ``serve_until_quiet``
whenever ``work_ready`` is set instead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from engine.errors import ClosedError, ContextFullError
from engine.runtime.architecture import ArchitectureFacts
from engine.runtime.draft_tree import DraftTree
from engine.runtime.native import NativeBatch, NativeContext, NativeModel
from engine.runtime.prefill import Prefill
from engine.runtime.target import Target, Verification, greedy_one_at_a_time

# How long a batch waits for answers still choosing their next token (Python work between
# decodes) before it goes with the rows it has.
GATHER_S = 0.002
# How long ``serve_until_quiet`` waits for more work before it gives the thread back.
QUIET_S = 0.05


_TIMEOUT = object()  # no work came while a batch waited for more rows
T = TypeVar("T")


@dataclass
class _Decode:
    token: int
    position: int
    seq: int
    done: Future


@dataclass
class _Call:
    fn: Callable[[], Any]
    done: Future[Any]


def one_stream_of(blob: np.ndarray, n_streams: int) -> np.ndarray:
    """A sequence's state from a cache of one KV stream (the target's), as a cache of
    ``n_streams`` streams reads it. llama.cpp's sequence state is a magic number and the
    sequence id (u32 each), the stream count (u32), then per stream its cell count (u32)
    and, where cells, their positions and rows. A sequence's cells are read into that
    sequence's own stream whichever section holds them, so: the count, the one section,
    and empty sections for the others. (A sliding-window model's state is two caches one
    after the other: not this.)"""
    words = np.frombuffer(blob[:12].tobytes(), dtype=np.uint32)
    if words[2] != 1:
        raise ValueError(f"expected the state of one KV stream, got {words[2]}")
    empty = np.zeros(n_streams - 1, dtype=np.uint32).view(np.uint8)
    return np.concatenate([blob[:8], np.array([n_streams], dtype=np.uint32).view(np.uint8),
                           blob[12:], empty])


class ParallelLanes:
    """Up to ``n_lanes`` answers at once on ``target``'s model. ``lane()`` hands out a
    sequence (blocking while all are in use); ``serve_forever`` runs the native work
    until ``close``."""

    def __init__(self, target: Target, n_lanes: int) -> None:
        self.target = target
        self.n_lanes = max(1, n_lanes)
        self.ctx: NativeContext = target.lane_context(self.n_lanes)
        self.batch = NativeBatch(self.n_lanes, self.n_lanes)
        self._work: queue.Queue[_Decode | _Call | None] = queue.Queue()  # None: close
        # Set while work waits that no serving loop has taken (``serve_until_quiet``).
        self.work_ready = threading.Event()
        self._work_lock = threading.Lock()
        self._closed = False
        self._freed = False
        self._free = queue.Queue[int]()
        for seq in range(self.n_lanes):
            self._free.put(seq)
        self._decoding: set[int] = set()  # lanes past their prompt, not yet finished
        self._lock = threading.Lock()
        self.rows_decoded: list[int] = []  # each batch's rows, for the figures

    # --- the answers' side ---------------------------------------------------------------
    def lane(self, timeout: float | None = None) -> LaneTarget:
        """A free lane, as a target ``generate`` runs on; ``release`` it after."""
        seq = self._free.get(timeout=timeout)
        return LaneTarget(self, seq)

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the native thread, between batches; its result or exception."""
        done: Future[T] = Future()
        self._put(_Call(fn, done))
        return done.result()

    def _decode(self, token: int, position: int, seq: int) -> np.ndarray:
        done: Future = Future()
        self._put(_Decode(token, position, seq, done))
        return done.result()

    def _put(self, item: _Decode | _Call | None) -> None:
        with self._work_lock:
            if self._closed:
                if item is not None:
                    raise ClosedError("lanes' context")
                return
            self._closed = item is None
            self._work.put(item)
            self.work_ready.set()

    def _set_decoding(self, seq: int, on: bool) -> None:
        with self._lock:
            (self._decoding.add if on else self._decoding.discard)(seq)
        self._put(_Call(lambda: None, Future()))  # a batch waiting on it looks again

    def _release(self, seq: int) -> None:
        try:
            self._set_decoding(seq, False)
            self.run(lambda: self.ctx.kv_remove(seq, -1, -1))
        except ClosedError:
            pass  # the cells go with the context
        self._free.put(seq)

    # --- the native thread ---------------------------------------------------------------
    def serve_forever(self) -> None:
        """Run prompt reads and batches until ``close``. On the engine's thread."""
        self._serve(quiet_s=None)

    def serve_until_quiet(self) -> bool:
        """Run prompt reads and batches until no work has come for ``QUIET_S`` (every
        answer between its tokens, or none running); False after ``close``. On the
        engine's thread, when ``work_ready`` is set."""
        return self._serve(quiet_s=QUIET_S)

    def _serve(self, quiet_s: float | None) -> bool:
        pending: list[_Decode] = []
        item: object  # a _Decode, a _Call, None (close) or _TIMEOUT
        while True:
            try:
                item = self._work.get(timeout=GATHER_S if pending else quiet_s)
            except queue.Empty:
                if not pending:  # quiet: give the thread back unless work just came
                    with self._work_lock:
                        if self._work.empty():
                            self.work_ready.clear()
                            return True
                    continue
                item = _TIMEOUT
            if item is None:  # close: what is left is answered with the error
                for left in pending:
                    left.done.set_exception(ClosedError("lanes' context"))
                return False
            if isinstance(item, _Call):
                self._call(item)
            elif isinstance(item, _Decode):
                pending.append(item)
            with self._lock:
                waiting_for = len(self._decoding)
            if pending and (len(pending) >= waiting_for or item is _TIMEOUT):
                self._run_batch(pending)
                pending = []

    @staticmethod
    def _call(item: _Call) -> None:
        try:
            item.done.set_result(item.fn())
        except BaseException as exc:  # noqa: BLE001 - it belongs to the caller
            item.done.set_exception(exc)

    def _run_batch(self, rows: list[_Decode]) -> None:
        self.batch.fill([r.token for r in rows], [r.position for r in rows],
                        [(r.seq,) for r in rows], True)
        try:
            self.ctx.decode(self.batch)
        except BaseException as exc:  # noqa: BLE001 - every answer in it hears
            for r in rows:
                r.done.set_exception(exc)
            return
        logits = self.ctx.logits_view(len(rows))
        self.rows_decoded.append(len(rows))
        for i, r in enumerate(rows):
            r.done.set_result(logits[i].copy())

    def close(self) -> None:
        """Stop ``serve_forever`` after the work queued before; work asked for later
        raises ClosedError."""
        self._put(None)

    def fail_what_waits(self) -> None:
        """After ``close``, with no loop serving: answer every queued item with
        ClosedError (the model is about to go)."""
        closing = False
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is None:
                closing = True
            else:
                item.done.set_exception(ClosedError("lanes' context"))
        if closing:  # a serving loop still to come sees the close
            self._work.put(None)

    def free(self) -> None:
        """Free the native context; after ``serve_forever`` returned. Once."""
        if not self._freed:
            self._freed = True
            self.ctx.close()
            self.batch.close()


class LaneTarget:
    """One lane as a ``DecodingTarget`` (engine.decoding.target_contract) for ``generate``:
    the prompt read by the engine's target and moved into this lane's sequence, then one
    token at a time as a row of the lanes' batch. It verifies the root alone: no drafter
    runs in lanes (drafts and other answers would compete for the same rows of the same
    cores), so its answers to "what can you verify" are those of a target without
    drafts, each with its reason."""

    def __init__(self, lanes: ParallelLanes, seq: int) -> None:
        self._lanes, self.seq = lanes, seq
        self._target = lanes.target
        self.n_past = 0

    # --- the model: the engine's target's ------------------------------------------------
    @property
    def model(self) -> NativeModel:
        """The engine's target's model: the lanes' context decodes its weights."""
        return self._target.model

    @property
    def arch(self) -> ArchitectureFacts:
        """The engine's target's architecture: the same model in another context."""
        return self._target.arch

    def is_end_of_generation(self, token: int, /) -> bool:
        return self._target.is_end_of_generation(token)

    def token_bytes(self, token: int, /) -> bytes:
        return self._target.token_bytes(token)

    def tokenize(self, text: str, /, special: bool = False) -> list[int]:
        return self._target.tokenize(text, special=special)

    # --- what a lane verifies: the root alone --------------------------------------------
    @property
    def trees(self) -> bool:
        """False: a lane verifies no draft, so no tree either."""
        return False

    @property
    def max_draft(self) -> int:
        """0: a lane verifies the root alone (no drafter runs in lanes)."""
        return 0

    @property
    def max_leaves(self) -> int:
        """0: with no draft there is no tree to give leaves a sequence each."""
        return 0

    @property
    def n_parked(self) -> int:
        """0: cells are parked for a tree's rejected tokens, and a lane verifies none."""
        return 0

    def compact(self) -> None:
        """Nothing to do: nothing is parked in a lane."""

    @property
    def greedy_in_c(self) -> bool:
        """False: a lane's decodes are rows of the lanes' shared batch, a token at a time
        (``decode_greedy`` goes through ``decode_one``)."""
        return False

    def set_features(self, on: bool, /) -> None:
        """Off only: a lane decodes without features (no drafter reads them)."""
        if on:
            raise ValueError("lanes decode without features (no drafter)")

    # --- the lane's sequence: its prompt, then a token at a time -------------------------
    @property
    def n_ctx(self) -> int:
        """The target's context: the lanes' context gives each sequence as many cells
        (``Target.lane_context``)."""
        return self._target.n_ctx

    @property
    def n_used(self) -> int:
        """``n_past``: nothing is parked in a lane."""
        return self.n_past

    def prefill(self, prompt: list[int], feature_tail: int | None = None, /) -> Prefill:
        """Read ``prompt`` as an answer alone reads it, and move its cells here."""
        def read() -> Prefill:
            self._target.set_features(False)  # as plain decoding reads a prompt
            pre = self._target.prefill(prompt)
            # A long prompt's cells may still wait in the F16 context (a pending move):
            # moved into sequence 0 first, or the lane would get none of them.
            self._target.settle()
            blob = one_stream_of(self._target.ctx.state_seq_array(0), self._lanes.n_lanes)
            self._lanes.ctx.state_seq_set(self.seq, blob)  # replaces the lane's cells
            return Prefill(pre.logits.copy(), None, pre.n_reused)

        pre = self._lanes.run(read)
        self.n_past = len(prompt)
        self._lanes._set_decoding(self.seq, True)
        return pre

    def verify(self, root: int, draft: DraftTree, /) -> Verification:
        if len(draft):
            raise ValueError("a lane verifies no drafts")
        if self.n_past + 1 > self.n_ctx:
            raise ContextFullError(self.n_past + 1, self.n_ctx, what="verification batch")
        logits = self._lanes._decode(root, self.n_past, self.seq)
        return Verification(logits[None, :], None, {0: 0}, [(0,)], [0])

    def commit(self, verification: Verification, path: list[int], path_tokens: list[int],
               /) -> None:
        self.n_past += len(path)

    def decode_one(self, token: int) -> np.ndarray:
        """Plain decoding's step (``Target.decode_one``): ``verify`` and ``commit`` of
        ``token`` alone; the logits after it."""
        if self.n_past + 1 > self.n_ctx:
            raise ContextFullError(self.n_past + 1, self.n_ctx, what="verification batch")
        logits = self._lanes._decode(token, self.n_past, self.seq)
        self.n_past += 1
        return logits

    def decode_greedy(self, token: int, n_max: int, /) -> tuple[list[int], list[float]]:
        """``Target.decode_greedy``, through ``decode_one``."""
        return greedy_one_at_a_time(self, token, n_max)

    def rollback(self, n_keep: int, /) -> None:
        self.n_past = n_keep  # the lane's cells go when it is released

    def release(self) -> None:
        """Give the lane back (its cells dropped); once, after ``generate`` returned."""
        self._lanes._release(self.seq)
