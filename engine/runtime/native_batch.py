"""Reusable batches of llama.cpp: ``llama_batch`` (tokens) and ``llama_batch_ext`` (rows
that carry a vector: an encoder's input, an eagle3 head's decoder). Thin wrappers: each
has an idempotent ``close()`` and works as a context manager."""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import llama_cpp
import numpy as np

from engine.errors import ClosedError, ModelLoadError, NativeError


class _Context(Protocol):
    """What an extended batch needs of its context (a LlamaContext)."""

    @property
    def handle(self) -> Any: ...


class NativeBatch:
    """A reusable ``llama_batch`` of up to ``n_tokens_max`` tokens."""

    def __init__(self, n_tokens_max: int, n_seq_max: int) -> None:
        self.n_tokens_max = n_tokens_max
        self.n_seq_max = n_seq_max
        self._batch = llama_cpp.llama_batch_init(n_tokens_max, 0, n_seq_max)
        self._open = True

    @property
    def raw(self) -> llama_cpp.llama_batch:
        if not self._open:
            raise ClosedError("batch")
        return self._batch

    def fill(
        self,
        tokens: list[int],
        positions: list[int],
        seq_ids: list[tuple[int, ...]] | None,
        outputs: list[bool] | bool,
    ) -> None:
        """Fill the batch. ``seq_ids`` None puts every token in sequence 0."""
        n = len(tokens)
        if n > self.n_tokens_max:
            raise ValueError(f"batch of {n} tokens exceeds its capacity {self.n_tokens_max}")
        b = self.raw
        tok, pos, nsq, sq, lg = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        for i in range(n):
            tok[i] = tokens[i]
            pos[i] = positions[i]
            if seq_ids is None:
                nsq[i] = 1
                sq[i][0] = 0
            else:
                ids = seq_ids[i]
                nsq[i] = len(ids)
                row = sq[i]
                for j, s in enumerate(ids):
                    row[j] = s
            lg[i] = outputs if isinstance(outputs, bool) else outputs[i]
        b.n_tokens = n

    def fill_one(self, token: int, position: int) -> None:
        """The plain-decoding fast path: one token of sequence 0, with its output."""
        b = self.raw
        b.token[0] = token
        b.pos[0] = position
        b.n_seq_id[0] = 1
        b.seq_id[0][0] = 0
        b.logits[0] = 1
        b.n_tokens = 1

    def close(self) -> None:
        if self._open:
            llama_cpp.llama_batch_free(self._batch)
            self._open = False

    def __enter__(self) -> NativeBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _embd(vector: np.ndarray) -> tuple[llama_cpp.llama_embd, np.ndarray]:
    """One row as llama.cpp's ``llama_embd``, with the float32 array it points into: the
    caller keeps that array alive until llama.cpp has copied the row (when it is added)."""
    row = np.ascontiguousarray(vector, dtype=np.float32)
    return (llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1,
                                 row.shape[-1]), row)


class NativeExtBatch:
    """A reusable extended batch (``llama_batch_ext``) of one context: rows that carry a
    vector, alone (an encoder's input) or beside a token (an eagle3 head's decoder)."""

    def __init__(self, ctx: _Context) -> None:
        self._batch = llama_cpp.llama_batch_ext_init(ctx.handle)
        if not self._batch:
            raise ModelLoadError("cannot make an extended batch")
        self.n_rows = 0

    @property
    def raw(self) -> ctypes.c_void_p:
        if not self._batch:
            raise ClosedError("batch")
        return self._batch

    def clear(self) -> None:
        llama_cpp.llama_batch_ext_clear(self.raw)
        self.n_rows = 0

    def add_vector(self, row: np.ndarray, position: int, seq_id: int = 0,
                   output: bool = True) -> None:
        """A row that is a vector alone."""
        embd, _kept = _embd(row)
        self._added(llama_cpp.llama_batch_ext_add_embd(self.raw, seq_id, embd), position,
                    output)

    def add_token(self, token: int, vector: np.ndarray, position: int, seq_id: int = 0,
                  output: bool = False) -> None:
        """A row that is a token with a vector beside it."""
        i = llama_cpp.llama_batch_ext_add_token(self.raw, seq_id, token)
        embd, _kept = _embd(vector)
        if i >= 0 and not llama_cpp.llama_batch_ext_set_embd_token(self.raw, i, embd):
            i = -2
        self._added(i, position, output)

    def _added(self, i: int, position: int, output: bool) -> None:
        if i < 0:
            raise NativeError("llama_batch_ext_add", i, {-1: "the batch is full",
                                                         -2: "invalid token or vector",
                                                         -3: "invalid sequence"}.get(i, ""))
        pos = llama_cpp.llama_pos(position)
        llama_cpp.llama_batch_ext_set_pos(self.raw, i, ctypes.byref(pos))
        llama_cpp.llama_batch_ext_set_output_logits(self.raw, i, output)
        self.n_rows += 1

    def close(self) -> None:
        if self._batch:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None

    def __enter__(self) -> NativeExtBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


