"""A llama.cpp context: the KV cache and compute graph of one model, made with exactly the
parameters given (``ContextParams``). A thin wrapper: which cache types, attention kernel
and shift rule Tandem runs with is engine.runtime.native_policy's to decide.

Decodes pass engine.runtime.decode_gate's gate (decodes of different contexts run at once,
a prompt-kernel section runs alone) and then the context's own lock (llama.cpp's contexts
are not thread-safe: one context never runs two decodes at once). Gate first, then lock,
always: a prompt-kernel section's thread decodes inside it, so a lock held while waiting at
the gate could wait for that section forever.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llama_cpp
import numpy as np

from engine.errors import ClosedError, ContextFullError, ModelLoadError, NativeError
from engine.runtime.decode_gate import DECODE_GATE
from engine.runtime.llama_bindings import (
    DECODE_MEANINGS,
    GREEDY_RUN_MAX,
    KV_TYPES,
    PARTIAL_STATE,
    ensure_backend,
    greedy_run_api,
    log_mark,
    logits_row_address,
    native_errors_since,
)
from engine.runtime.native_features import HiddenStates

if TYPE_CHECKING:
    from engine.runtime.native_batch import NativeBatch, NativeExtBatch
    from engine.runtime.native_model import NativeModel


@dataclass(frozen=True)
class ContextParams:
    """What a context is made with, every choice explicit (llama.cpp's context params).
    Cache types are llama.cpp's names ("f16", "q8_0")."""

    n_ctx: int
    n_batch: int  # also the micro-batch: one batch is computed as one graph
    n_seq_max: int
    n_threads: int  # one-token decodes and batches alike
    type_k: str
    type_v: str  # a quantized V needs flash attention (llama.cpp refuses it otherwise)
    flash_attn: bool
    features: bool = False  # hidden states out too (llama.cpp's embeddings mode)
    # One KV buffer for every sequence (a token in several sequences, as tree
    # verification puts it); False: one stream per sequence.
    unified_kv: bool = True
    # Recurrent-state snapshots kept per sequence: that many tokens can be taken back
    # after a decode (architectures that support it).
    n_rs_seq: int = 0
    # In a build that can offload, a batch of 32+ tokens runs on the GPU even for weights
    # kept on the CPU; False: every batch stays on the CPU.
    op_offload: bool = True
    feature_layers: tuple[int, ...] = ()  # with features: these layers' inputs instead
    mtp: bool = False  # run the model's next-token (MTP) block instead of its trunk
    # False: ``can_shift`` says no even where llama.cpp would shift (a caller's rule).
    shift: bool = True


class LlamaContext(HiddenStates):
    """A llama.cpp context over a loaded model (its hidden-state outputs:
    engine.runtime.native_features)."""

    def __init__(self, model: NativeModel, params: ContextParams,
                 ctx_other: LlamaContext | None = None) -> None:
        """Raises ModelLoadError when llama.cpp cannot create the context (memory, or a
        combination it refuses). ``ctx_other``: the target context an eagle3 head borrows
        its token embedding and LM head from (it must outlive this one; the two share
        one lock, so they never decode at once)."""
        ensure_backend()
        if params.mtp and not model.mtp_loaded:
            # llama.cpp would make the context, then abort on its first decode.
            why = ("it has no next-token (MTP) blocks" if not model.n_layer_nextn
                   else "its next-token blocks were not loaded")
            raise ModelLoadError(f"cannot run {model.path.name}'s MTP block: {why}")
        self.model = model
        self.params = params
        raw = llama_cpp.llama_context_default_params()
        raw.n_ctx = params.n_ctx
        raw.n_batch = raw.n_ubatch = params.n_batch
        raw.n_seq_max = params.n_seq_max
        raw.n_threads = raw.n_threads_batch = params.n_threads
        raw.embeddings = params.features
        raw.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        raw.kv_unified = params.unified_kv
        raw.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if params.flash_attn
                               else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        raw.n_rs_seq = params.n_rs_seq
        raw.op_offload = params.op_offload
        raw.type_k = KV_TYPES[params.type_k]
        raw.type_v = KV_TYPES[params.type_v]
        if ctx_other is not None:
            raw.ctx_other = ctx_other.handle
        if params.mtp:
            raw.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        mark = log_mark()
        handle = llama_cpp.llama_init_from_model(model.handle, raw)
        if not handle:
            why = native_errors_since(mark) or "out of memory?"
            raise ModelLoadError(f"cannot create a {params.n_ctx}-token context: {why}")
        self._handle = handle
        self._memory = llama_cpp.llama_get_memory(handle)
        self._lock = ctx_other._lock if ctx_other is not None else threading.Lock()
        self.flash_attn = params.flash_attn
        self.op_offload = params.op_offload
        self.last_batch_start = 0
        # Recurrent state (an MTP context's memory is one plain KV layer even on a hybrid).
        self._stateful = not params.mtp and model.architecture().has_state
        self.n_ctx = int(llama_cpp.llama_n_ctx(handle))
        self.n_batch = params.n_batch
        self.n_seq_max = params.n_seq_max
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd
        self._features = params.features
        self._llama_embeddings = params.features
        self.feature_layers = ()
        self.next_features = False
        self._llama_nextn = False
        try:
            self.set_feature_layers(params.feature_layers)
        except BaseException:
            self.close()
            raise
        # The last logits row's view, by the address llama.cpp gave: plain decoding reads
        # one row every step, and numpy's ctypes route rebuilt an array type each time
        # (docs/benchmarks.md: figures behind the code's rules, "Per-step costs").
        self._row_view: tuple[int, np.ndarray] = (0, np.empty(0, np.float32))

    @property
    def handle(self) -> llama_cpp.llama_context_p:
        if self._handle is None:
            raise ClosedError("context")
        return self._handle

    @property
    def memory(self) -> llama_cpp.llama_memory_t:
        if self._handle is None:
            raise ClosedError("context")
        return self._memory

    def close(self) -> None:
        if self._handle is not None:
            with self._lock:  # not under a decode of another thread
                llama_cpp.llama_free(self._handle)
                self._handle = None
                self._memory = None  # freed with the context

    def __enter__(self) -> LlamaContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_n_threads(self, n_threads: int) -> None:
        """Decode with ``n_threads`` threads from the next decode on (one-token decodes
        and batches alike)."""
        llama_cpp.llama_set_n_threads(self.handle, n_threads, n_threads)

    # --- running batches -------------------------------------------------------------------
    def run_native(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a native call that computes on this context: alone on it, beside
        other contexts' decodes, never inside another thread's prompt-kernel section."""
        entered = DECODE_GATE.enter_shared()
        try:
            with self._lock:
                return call(*args)
        finally:
            DECODE_GATE.leave_shared(entered)

    def decode(self, batch: NativeBatch) -> None:
        """Run the batch. Raises ContextFullError (KV full) or NativeError."""
        raw = batch.raw
        # Where it starts: recurrent state can be taken back only within the last batch.
        self.last_batch_start = int(raw.pos[0]) if raw.n_tokens else 0
        rc = self.run_native(llama_cpp.llama_decode, self.handle, raw)
        self.check_decode(rc, raw.n_tokens)

    def process(self, batch: NativeExtBatch, encode: bool) -> None:
        """Run an extended batch: an encoder pass (rows of features) or a decoder pass.
        Raises ContextFullError or NativeError as ``decode`` does."""
        kind = (llama_cpp.LLAMA_PROCESS_TYPE_ENCODE if encode
                else llama_cpp.LLAMA_PROCESS_TYPE_DECODE)
        rc = self.run_native(llama_cpp.llama_process, self.handle, kind, batch.raw)
        self.check_decode(rc, batch.n_rows, "head batch", call="llama_process")

    def check_decode(self, rc: int, n_tokens: int = 1, what: str = "batch",
                     call: str = "llama_decode") -> None:
        """A return code of llama_decode (or ``call``: llama_process, Tandem's greedy loop)
        over ``n_tokens`` tokens as an error: ContextFullError for 1 (no KV slot),
        NativeError for any other but 0."""
        if rc == 1:
            raise ContextFullError(n_tokens, self.n_ctx, what=what)
        if rc != 0:
            raise NativeError(call, rc, DECODE_MEANINGS.get(rc, ""))

    # --- outputs ---------------------------------------------------------------------------
    def logits_view(self, n_outputs: int) -> np.ndarray:
        """No-copy view of the last decode's logits, [n_outputs, n_vocab]; valid until the
        next decode (a verification's rows are read before it: at a 262k vocabulary a
        17-row copy was 17.8 MB a step)."""
        ptr = llama_cpp.llama_get_logits(self.handle)
        return np.ctypeslib.as_array(ptr, shape=(n_outputs, self.n_vocab))

    def logits(self, n_outputs: int) -> np.ndarray:
        """Copy of the logits of the last decode's outputs, shape [n_outputs, n_vocab]."""
        return self.logits_view(n_outputs).copy()

    def argmax_logits(self, n_outputs: int) -> list[int]:
        """The highest-scoring token of each output of the last decode (no copy)."""
        return self.logits_view(n_outputs).argmax(-1).tolist()

    def last_logits_view(self, n_outputs: int) -> np.ndarray:
        """No-copy view of the last output's logits; valid until the next decode."""
        address = logits_row_address()(self.handle, n_outputs - 1)
        if not address:
            raise NativeError("llama_get_logits_ith", n_outputs - 1, "no logits for that output")
        if address != self._row_view[0]:
            row = (ctypes.c_float * self.n_vocab).from_address(address)
            self._row_view = (address, np.frombuffer(row, dtype=np.float32))
        return self._row_view[1]

    # --- the KV cache. Positions: p0 inclusive, p1 exclusive, negative means open-ended ---
    def kv_remove(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        """False when the memory cannot drop that range: recurrent state past its
        snapshots (nothing was removed then). Snapshots are the states after each token
        of the last batch: llama.cpp's seq_rm says true further back too, with the state
        wrong (a new prompt parting 3-8 tokens before the cache's end gave other logits
        than a fresh prefill, max diff 6), so that is refused here."""
        if self._stateful and 0 < p0 <= self.last_batch_start:
            return False
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def kv_copy(self, seq_src: int, seq_dst: int, p0: int = -1, p1: int = -1) -> None:
        llama_cpp.llama_memory_seq_cp(self.memory, seq_src, seq_dst, p0, p1)

    def kv_clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def kv_shift(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Add ``delta`` to the positions in [p0, p1) of the sequence. K is rotated to
        the new positions at the next decode (a RoPE of the difference; on a quantized K
        through F32 and back, so its numbers change)."""
        llama_cpp.llama_memory_seq_add(self.memory, seq_id, p0, p1, delta)

    @property
    def can_shift(self) -> bool:
        """Whether positions may be shifted: the params allow it and the memory can (not
        recurrent state, not M-RoPE)."""
        return self.params.shift and bool(llama_cpp.llama_memory_can_shift(self.memory))

    def kv_pos_max(self, seq_id: int) -> int:
        """Largest position held by the sequence, -1 when it is empty."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id))

    def kv_pos_min(self, seq_id: int) -> int:
        """Smallest position held by the sequence, -1 when it is empty. For a
        sliding-window model, the window cache's: llama.cpp reuses cells that have left
        the window for new tokens (and then drops every earlier position of theirs)."""
        return int(llama_cpp.llama_memory_seq_pos_min(self.memory, seq_id))

    # --- a sequence's serialized state ---------------------------------------------------
    def state_seq_get(self, seq_id: int) -> bytes:
        """llama.cpp's serialized cells of one sequence (engine.runtime.kv_transfer reads it)."""
        return self.state_seq_array(seq_id).tobytes()

    def state_seq_array(self, seq_id: int, into: np.ndarray | None = None,
                        partial: bool = False) -> np.ndarray:
        """``state_seq_get`` as a uint8 array, with no copy. A fresh ``bytes`` (or a ctypes
        array) of a long prompt's cells is touched page by page; numpy's large arrays get
        huge pages, much sooner (docs/benchmarks.md: figures behind the code's rules,
        "Moving a prompt's cells"). ``into``: a uint8 array to write it in when it is
        big enough (the result is a view of it). ``partial``: only the recurrent state
        (or the window cache), not the attention cells (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)."""
        mark = log_mark()
        flags = PARTIAL_STATE if partial else 0
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.handle, seq_id, flags))
        buffer = into if into is not None and into.size >= size and into.dtype == np.uint8 \
            else np.empty(size, dtype=np.uint8)
        written = int(llama_cpp.llama_state_seq_get_data_ext(
            self.handle, buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq_id,
            flags))
        if not written:
            raise NativeError("llama_state_seq_get_data", 0, native_errors_since(mark))
        return buffer[:written]

    def state_seq_set(self, seq_id: int, blob: bytes | np.ndarray,
                      partial_at: int | None = None) -> None:
        """Replace the sequence's cells with a blob from ``state_seq_get`` (of a cache of
        the same types); on failure llama.cpp leaves the sequence empty. ``partial_at``:
        a blob of the recurrent state alone (``state_seq_array(partial=True)``) as it
        stood after that many tokens; the attention cells are left as they are (those
        after it are the caller's to remove)."""
        mark = log_mark()
        data = np.frombuffer(blob, dtype=np.uint8)  # read in place, no copy
        buffer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        flags = 0 if partial_at is None else PARTIAL_STATE
        if not llama_cpp.llama_state_seq_set_data_ext(self.handle, buffer, len(blob), seq_id,
                                                      flags):
            raise NativeError("llama_state_seq_set_data", 0, native_errors_since(mark))
        if self._stateful:
            # Restored state comes without snapshots (llama.cpp resets their index): no
            # token of it can be taken back until a decode writes new ones; cells after
            # a partial state's last token can go (the state is not theirs).
            self.last_batch_start = 2**31 - 1 if partial_at is None else partial_at - 1


def native_argmax(row: np.ndarray) -> int:
    """The C loop's argmax of a float32 row (the first maximum, a NaN the largest: as
    numpy's). Raises RuntimeError in a build without it."""
    api = greedy_run_api()
    if api is None:
        raise RuntimeError("this llama.cpp build lacks Tandem's greedy loop")
    row = np.ascontiguousarray(row, dtype=np.float32)
    return int(api["argmax"](row.ctypes.data, row.size))


class GreedyRun:
    """The C greedy loop over one batch and stop set, its buffers made once."""

    @staticmethod
    def available() -> bool:
        return greedy_run_api() is not None

    def __init__(self, batch: NativeBatch, stop: frozenset[int]) -> None:
        api = greedy_run_api()
        if api is None:
            raise RuntimeError("this llama.cpp build lacks Tandem's greedy loop")
        self._run = api["run"]
        self._batch = batch
        self.stop = stop
        self._stop = (ctypes.c_int32 * max(1, len(stop)))(*sorted(stop))
        self._n_stop = len(stop)
        self._out = (ctypes.c_int32 * GREEDY_RUN_MAX)()
        self._seconds = (ctypes.c_double * GREEDY_RUN_MAX)()
        self._status = ctypes.c_int32()

    def __call__(self, ctx: LlamaContext, token: int, pos: int, n_max: int
                 ) -> tuple[list[int], list[float], int]:
        """Decode ``token`` at ``pos`` in ``ctx``'s sequence 0, then each chosen token, up to
        ``n_max`` (1 to GREEDY_RUN_MAX) choices or a stop token (chosen, not decoded).
        Returns the tokens chosen, each one's seconds (its decode and choice) and the return
        code of a decode that failed after the first (0: none did; else the run ended
        early, and its cells past the chosen tokens are the caller's to drop). Raises
        ContextFullError or NativeError when the first decode fails."""
        if not 1 <= n_max <= GREEDY_RUN_MAX:
            raise ValueError(f"a greedy run chooses 1 to {GREEDY_RUN_MAX} tokens, not {n_max}")
        # One gate pass for the whole run (about 50 ms): a prompt-kernel section on another
        # thread waits that long; other contexts' decodes run beside it.
        n = ctx.run_native(self._run, ctx.handle, ctypes.byref(self._batch.raw), token, pos,
                           n_max, self._stop, self._n_stop, self._out, self._seconds,
                           ctypes.byref(self._status))
        rc = self._status.value
        if n == 0:
            ctx.last_batch_start = pos
            ctx.check_decode(rc)
        ctx.last_batch_start = pos + n - 1
        return self._out[:n], self._seconds[:n], rc
