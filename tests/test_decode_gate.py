"""Which decodes run at once (engine.runtime.decode_gate): decodes of different contexts
overlap (a draft model drafting ahead beside the target's verification), one context
never runs two decodes, and a prompt-kernel section runs alone. Each native decode is
wrapped to hold where the test says, so an overlap (or its absence) is seen, not timed:
a rule broken fails on a timeout, never on a speed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.runtime import native_context
from engine.runtime.decode_gate import DECODE_GATE, DecodeGate
from engine.runtime.native import (
    NativeBatch,
    NativeContext,
    NativeModel,
    prompt_kernels,
    prompt_kernels_available,
)

WAIT_S = 30.0  # what a rule kept never comes near; a rule broken fails on it
N_TOKENS = 16


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.002)


def _section() -> AbstractContextManager[bool]:
    """A prompt-kernel section; the gate's exclusive hold where the build lacks the
    switch (prompt_kernels then takes nothing: no kernels to keep apart)."""
    return prompt_kernels() if prompt_kernels_available() else DECODE_GATE.exclusive()


class Contexts:
    """Two contexts of the bundled model and a batch each, the same tokens in both."""

    def __init__(self, model: NativeModel, tokens: list[int]) -> None:
        self.tokens = tokens
        self.ctx = [NativeContext(model, n_ctx=128, n_batch=32, n_seq_max=1, n_threads=1,
                                  features=False) for _ in range(2)]
        self.batch = [NativeBatch(32, 1) for _ in range(2)]

    def decode(self, i: int) -> np.ndarray:
        """The prompt in context ``i`` from an empty cache; its last logits."""
        ctx, batch = self.ctx[i], self.batch[i]
        ctx.kv_clear()
        batch.fill(self.tokens, list(range(len(self.tokens))), None, True)
        ctx.decode(batch)
        return ctx.logits(len(self.tokens))[-1]

    def close(self) -> None:
        for handle in (*self.batch, *self.ctx):
            handle.close()


@pytest.fixture(scope="module")
def contexts(model_path: Path) -> Iterator[Contexts]:
    with NativeModel(model_path) as model:
        tokens = model.tokenize("The quick brown fox jumps over the lazy dog and", True,
                                False)[:N_TOKENS]
        made = Contexts(model, tokens)
        try:
            yield made
        finally:
            made.close()


class Watched:
    """llama_decode wrapped: who is inside it, per context, and where each call holds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._real = native_context.llama_cpp.llama_decode
        self._lock = threading.Lock()
        self.inside: dict[int, int] = {}  # context address -> decodes inside now
        self.most_inside: dict[int, int] = {}
        self.entered: list[str] = []  # thread names, in the order they got in
        self.hold: Callable[[], None] = lambda: None  # run inside, before the real decode
        monkeypatch.setattr(native_context.llama_cpp, "llama_decode", self._decode)

    def _decode(self, handle: Any, batch: Any) -> int:
        key = int(handle or 0)
        with self._lock:
            self.inside[key] = self.inside.get(key, 0) + 1
            self.most_inside[key] = max(self.most_inside.get(key, 0), self.inside[key])
            self.entered.append(threading.current_thread().name)
        try:
            self.hold()
            return self._real(handle, batch)
        finally:
            with self._lock:
                self.inside[key] -= 1


def _thread(name: str, work: Callable[[], object], errors: list[BaseException]
            ) -> threading.Thread:
    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _join(threads: list[threading.Thread], errors: list[BaseException]) -> None:
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), f"{thread.name} still waits"
    if errors:
        raise errors[0]


def test_two_contexts_decode_at_once_and_as_alone(contexts, monkeypatch):
    alone = [contexts.decode(0), contexts.decode(1)]
    watched = Watched(monkeypatch)
    both_in = threading.Barrier(2, timeout=WAIT_S)  # each decode waits for the other's
    watched.hold = both_in.wait
    logits: list[np.ndarray | None] = [None, None]
    errors: list[BaseException] = []

    def decode(i: int) -> None:
        logits[i] = contexts.decode(i)

    _join([_thread(f"decode-{i}", lambda i=i: decode(i), errors) for i in range(2)], errors)
    assert not both_in.broken  # they were inside llama_decode together
    assert np.array_equal(logits[0], alone[0]) and np.array_equal(logits[1], alone[1])


def test_one_context_runs_one_decode_at_a_time(contexts, monkeypatch):
    watched = Watched(monkeypatch)
    first_in, release = threading.Event(), threading.Event()

    def hold() -> None:
        if threading.current_thread().name == "first":
            first_in.set()
            assert release.wait(WAIT_S)

    def more() -> None:  # the tokens again, after the first decode's (its own batch)
        n = len(contexts.tokens)
        batch.fill(contexts.tokens, list(range(n, 2 * n)), None, True)
        contexts.ctx[0].decode(batch)

    watched.hold = hold
    errors: list[BaseException] = []
    first = _thread("first", lambda: contexts.decode(0), errors)
    assert first_in.wait(WAIT_S)
    batch = NativeBatch(32, 1)
    second = _thread("second", more, errors)
    # Past the gate (two shared holders), so waiting on the context's own lock.
    _until(lambda: DECODE_GATE.holders() == (2, False), "the second decode passed the gate")
    assert watched.entered == ["first"]
    release.set()
    try:
        _join([first, second], errors)
    finally:
        batch.close()
    assert watched.entered == ["first", "second"]
    assert max(watched.most_inside.values()) == 1


def test_a_prompt_kernel_section_keeps_other_threads_decodes_out(contexts, monkeypatch):
    watched = Watched(monkeypatch)
    errors: list[BaseException] = []
    with _section():
        other = _thread("other", lambda: contexts.decode(1), errors)
        _until(lambda: DECODE_GATE.waiting() == (1, 0), "the other thread's decode waits")
        contexts.decode(0)  # the section's own thread decodes inside it
        with _section():  # and nests sections
            pass
        assert watched.entered == ["MainThread"]
        assert DECODE_GATE.waiting() == (1, 0)
    _join([other], errors)
    assert watched.entered == ["MainThread", "other"]


def test_a_prompt_kernel_section_waits_for_decodes_and_goes_before_new_ones(
        contexts, monkeypatch):
    watched = Watched(monkeypatch)
    running, release = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> None:
        if threading.current_thread().name == "running":
            running.set()
            assert release.wait(WAIT_S)

    def section() -> None:
        with _section():
            order.append("section")

    watched.hold = hold
    errors: list[BaseException] = []
    first = _thread("running", lambda: contexts.decode(0), errors)
    assert running.wait(WAIT_S)
    prompt = _thread("prompt", section, errors)
    _until(lambda: DECODE_GATE.waiting() == (0, 1), "the section waits for the decode")
    # A decode that comes while the section waits goes after it (a stream of draft
    # decodes cannot keep a prompt out).
    late = _thread("late", lambda: (contexts.decode(1), order.append("late")), errors)
    _until(lambda: DECODE_GATE.waiting() == (1, 1), "the late decode waits too")
    assert order == [] and watched.entered == ["running"]
    release.set()
    _join([first, prompt, late], errors)
    assert order == ["section", "late"]
    assert watched.entered == ["running", "late"]


def test_the_gates_rules_without_a_model():
    gate = DecodeGate()
    assert gate.enter_exclusive() is True
    assert gate.enter_exclusive() is False  # nested
    assert gate.enter_shared() is False  # the holder's own decode: nothing to leave
    assert gate.leave_exclusive() is False
    errors: list[BaseException] = []
    stranger = _thread("stranger", gate.leave_exclusive, errors)
    stranger.join(WAIT_S)
    assert isinstance(errors[0], RuntimeError)
    assert gate.leave_exclusive() is True
    assert gate.holders() == (0, False)
    assert gate.enter_shared() is True and gate.enter_shared() is True  # other contexts
    assert gate.holders() == (2, False)
    gate.leave_shared()
    gate.leave_shared()
    assert gate.holders() == (0, False)
