"""Decoding follows the machine's load: as many threads as the physical cores that
programs at our priority leave (niced ones give way), chosen between answers, and the
answers stay the same whatever the thread count."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest

from engine.decoding import generation
from engine.planning import thread_choice
from engine.planning.machine_load import (
    LoadReading,
    RecentLoad,
    _CpuTimes,
    look_at_load,
    niced_share,
)
from engine.planning.thread_choice import (
    EARLY_STEPS,
    RETRY_STEPS,
    WINDOW_STEPS,
    AnswerThreads,
    ThreadFollower,
    threads_for,
)
from engine.runtime.draft_tree import DraftTree
from engine.runtime.target import Target, TargetConfig

PHYSICAL = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def test_threads_are_the_cores_programs_at_our_priority_leave() -> None:
    quiet = LoadReading(0.1, 1.0, 0)
    one_busy = LoadReading(1.0, 1.0, 0)
    niced = LoadReading(1.9, 1.0, 0, niced_cores=1.9)
    assert threads_for(quiet, 2, physical=2).n_threads == 2
    assert "quiet" in threads_for(quiet, 2, physical=2).why
    assert threads_for(one_busy, 2, physical=2).n_threads == 1
    assert "hold 1.0 of 2 cores" in threads_for(one_busy, 2, physical=2).why
    assert threads_for(niced, 2, physical=2).n_threads == 2
    assert "give way" in threads_for(niced, 2, physical=2).why
    assert threads_for(LoadReading(1.5, 1.0, 0), 8, physical=8).n_threads == 6
    assert threads_for(LoadReading(7.5, 1.0, 0), 8, physical=8).n_threads == 1  # never 0
    assert threads_for(quiet, 1, physical=8).n_threads == 1  # never more than asked


@contextmanager
def _busy_loop(nice: int = 0) -> Iterator[None]:
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=(lambda: __import__("os").nice(nice)) if nice else None)
    try:
        time.sleep(0.3)  # started and spinning
        yield
    finally:
        loop.kill()
        loop.wait()


@pytest.mark.skipif(PHYSICAL < 2, reason="one core: nothing to give up")
def test_a_busy_program_takes_a_thread_and_a_niced_one_does_not() -> None:
    if look_at_load(PHYSICAL, 0.6).competing_cores > 0.5:
        pytest.skip("another program keeps a core busy already")
    follower = ThreadFollower(PHYSICAL)
    with _busy_loop():
        follower.idle()
        time.sleep(0.6)
        busy = follower.next_answer()
    assert busy.n_threads == PHYSICAL - 1, busy.why
    with _busy_loop(nice=19):
        follower.idle()
        time.sleep(0.6)
        niced = follower.next_answer()
    assert niced.n_threads == PHYSICAL and "give way" in niced.why, niced.why
    follower.next_answer()  # no look since: the last choice stands
    assert follower.choice == niced


@pytest.mark.skipif(PHYSICAL < 2, reason="one core: nothing to give up")
def test_a_load_that_ended_before_the_last_seconds_does_not_count() -> None:
    """The next answer meets the machine as it is now: a program that was busy earlier
    in a long wait between answers (and ended) takes no thread from it."""
    if look_at_load(PHYSICAL, 0.6).competing_cores > 0.5:
        pytest.skip("another program keeps a core busy already")
    watch = RecentLoad(PHYSICAL, recent_s=1.0, step_s=0.25)
    with _busy_loop():
        time.sleep(1.5)
    time.sleep(1.6)
    reading = watch.read()
    assert 1.0 <= reading.wall_s < 1.6, reading  # the last second or so, not all 3.4 s
    assert reading.competing_cores < 0.25, reading
    # While it runs, it counts.
    with _busy_loop():
        watch = RecentLoad(PHYSICAL, recent_s=1.0, step_s=0.25)
        time.sleep(1.2)
        assert watch.read().competing_cores > 0.7


def test_kernel_time_is_shared_out_by_priority_as_user_time_is() -> None:
    # Others: 1.0 s niced user, no plain user, 0.5 s kernel: all of it gives way.
    assert niced_share(_CpuTimes(1.6, 0.05, 1.0, 0.55), 0.05, 0.05, False) == 1.5
    # Half the others' user time niced: half their kernel time too.
    assert niced_share(_CpuTimes(2.5, 1.0, 1.0, 0.5), 0.0, 0.0, False) == 1.25
    # Nothing niced: none of it; a niced Tandem's own user time is not another's.
    assert niced_share(_CpuTimes(2.0, 1.0, 0.0, 1.0), 0.5, 0.5, False) == 0.0
    assert niced_share(_CpuTimes(2.0, 0.0, 1.0, 1.0), 1.0, 1.0, True) == 0.0


@pytest.mark.skipif(PHYSICAL < 2, reason="one core: nothing to give up")
def test_a_niced_program_in_the_kernel_gives_way_too() -> None:
    """A niced build spends much of its time in system calls, which Linux does not count
    as niced: shared out by priority, it still leaves our cores ours."""
    if look_at_load(PHYSICAL, 0.6).competing_cores > 0.5:
        pytest.skip("another program keeps a core busy already")
    # Like a compile: mostly its own work, a good part in the kernel.
    code = "f = open('/dev/zero', 'rb', 0)\nwhile True: f.read(1 << 20); sum(range(2000))"
    loop = subprocess.Popen([sys.executable, "-c", code],
                            preexec_fn=lambda: __import__("os").nice(19))
    try:
        time.sleep(0.3)
        reading = look_at_load(PHYSICAL, 1.0)
    finally:
        loop.kill()
        loop.wait()
    assert reading.others_cores > 0.7, reading  # it ran, much of it in the kernel
    assert reading.competing_cores < 0.3, reading
    assert threads_for(reading, PHYSICAL).n_threads == PHYSICAL


def test_a_conversation_decodes_alike_on_any_thread_count(model_path: Path,
                                                          dev_prompts: list[dict]) -> None:
    """Logits are bit for bit the same with 2 threads throughout and with the threads
    changed between turns (a long prompt through the F16 context, a verified chain)."""
    rag = next(r for r in dev_prompts if r["category"] == "rag")["turns"][0]
    rows = {}
    for switch in (False, True):
        with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2)) as t:
            prompt = t.chat_prompt([{"role": "user", "content": rag}])
            got = [t.prefill(prompt).logits.copy()]
            last = int(np.argmax(got[-1]))
            for i in range(12):
                if switch and i == 6:
                    t.set_threads(1)
                ver = t.verify(last, DraftTree.chain([last, last]) if i % 4 == 3
                               else DraftTree())
                got.append(ver.logits.copy())
                t.commit(ver, [0], [last])
                last = int(np.argmax(got[-1][0]))
            rows[switch] = got
    for a, b in zip(rows[False], rows[True], strict=True):
        np.testing.assert_array_equal(a, b)


def _steps(tuner: AnswerThreads, seconds_at: dict[int, float], n_steps: int) -> None:
    """``n_steps`` one-token steps, each taking what the tuner's thread count takes now."""
    for _ in range(n_steps):
        tuner.observe(seconds_at[tuner.n], 0)


def test_an_answer_keeps_its_threads_while_tokens_come_as_before() -> None:
    calls: list[int] = []
    references: dict[tuple[int, int], float] = {}
    tuner = AnswerThreads(2, 2, references, calls.append)
    _steps(tuner, {1: 0.008, 2: 0.005}, 20 * WINDOW_STEPS)
    assert calls == [] and tuner.n == 2 and references[(2, 0)] == 0.005


def test_a_program_that_takes_a_core_mid_answer_moves_it_to_fewer_threads() -> None:
    """Tokens 3x slower on 2 threads than before: 1 thread is tried, kept while faster,
    2 are tried again after RETRY_STEPS (and kept once the program has gone)."""
    calls: list[int] = []
    references = {(2, 0): 0.005}  # what 2 threads took in an earlier answer
    tuner = AnswerThreads(2, 2, references, calls.append)
    busy = {1: 0.008, 2: 0.015}
    _steps(tuner, busy, WINDOW_STEPS)
    assert calls == [1]  # tried one thread fewer
    _steps(tuner, busy, WINDOW_STEPS)
    assert tuner.n == 1 and "kept 1" in tuner.changes[-1]
    _steps(tuner, busy, RETRY_STEPS)
    assert calls == [1, 2]  # more again, after RETRY_STEPS steps
    _steps(tuner, busy, EARLY_STEPS)
    assert calls == [1, 2, 1] and tuner.n == 1  # far slower at once: back, early
    _steps(tuner, busy, RETRY_STEPS)
    assert calls == [1, 2, 1]  # the wait doubled
    _steps(tuner, busy, RETRY_STEPS + EARLY_STEPS)
    assert calls == [1, 2, 1, 2, 1]
    _steps(tuner, {1: 0.008, 2: 0.005}, 4 * RETRY_STEPS + WINDOW_STEPS)  # it ended
    assert tuner.n == 2 and "kept 2" in tuner.changes[-1]


def test_a_slowdown_fewer_threads_do_not_cure_is_tried_once() -> None:
    """Tokens slower on 2 threads, but slower still on 1 (a longer context, a machine
    slow alike): back to 2, and the slower time becomes 2 threads' reference."""
    calls: list[int] = []
    references = {(2, 0): 0.005}
    tuner = AnswerThreads(2, 2, references, calls.append)
    slow = {1: 0.012, 2: 0.008}
    _steps(tuner, slow, 2 * WINDOW_STEPS)
    assert calls == [1, 2] and tuner.n == 2
    _steps(tuner, slow, 20 * WINDOW_STEPS)
    assert calls == [1, 2] and references[(2, 0)] == 0.008


def test_threads_changed_mid_answer_keep_the_answer(model_path: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that follows the load, made to switch between 2 threads and 1 every few
    tokens (every window counts as slow, every count is retried at once), answers as an
    engine fixed on 2 threads does."""
    from engine.decoding.generation import GenerationConfig
    from engine.session import Engine, EngineConfig

    if PHYSICAL < 2:
        pytest.skip("needs 2 physical cores to switch between")
    monkeypatch.setattr(thread_choice, "SLOWER", 0.0)
    monkeypatch.setattr(thread_choice, "RETRY_STEPS", 0)
    monkeypatch.setattr(thread_choice, "WINDOW_STEPS", 2)
    # Runs of 2 plain tokens: the count changes between them (a run decodes on one count)
    monkeypatch.setattr(generation, "PLAIN_RUN_MAX_TOKENS", 2)
    base = EngineConfig(model_path=model_path, drafter="none", n_ctx=512, cache_dir=tmp_path)
    messages = [{"role": "user", "content": "Tell me about the moon."}]
    answers, switches = {}, []
    for n_threads in (2, None):
        with Engine(replace(base, n_threads=n_threads)) as engine:
            if n_threads is None:
                def counted(n: int, real=engine.target.set_threads) -> None:
                    switches.append(n)
                    real(n)
                monkeypatch.setattr(engine.target, "set_threads", counted)
            result = engine.generate(engine.chat_prompt(messages),
                                     GenerationConfig(max_tokens=40))
            answers[n_threads] = result.tokens
    assert answers[None] == answers[2]
    assert switches.count(1) >= 5 and switches.count(2) >= 5, switches


def test_the_plan_says_what_changed_in_the_last_answer_only() -> None:
    follower = ThreadFollower(2)
    follower.choice = thread_choice.ThreadChoice(2, "2 threads: the machine is quiet")
    # Two answers in a row, no look between them: a program takes a core during the
    # first (2 threads to 1) and has gone in the second (1 to 2).
    for seconds_at, steps, ends_on in (({1: 0.008, 2: 0.015}, 2 * WINDOW_STEPS, 1),
                                       ({1: 0.008, 2: 0.005}, RETRY_STEPS + 2 * WINDOW_STEPS,
                                        2)):
        tuner = follower.during_answer(lambda n: None)
        assert tuner is not None
        tuner.references.setdefault((2, 0), 0.005)
        _steps(tuner, seconds_at, steps)
        follower.after_answer(tuner)
        assert follower.choice.n_threads == ends_on
        assert follower.choice.why.count("during the last answer") == 1, follower.choice.why
    assert follower.choice.why.startswith("2 threads: the machine is quiet")
