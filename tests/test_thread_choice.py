"""Decoding follows the machine's load: as many threads as the physical cores that
programs at our priority leave (niced ones give way), chosen between answers, and the
answers stay the same whatever the thread count."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest

from engine.planning.machine_load import (
    LoadReading,
    RecentLoad,
    _CpuTimes,
    look_at_load,
    niced_share,
)
from engine.planning.thread_choice import ThreadFollower, threads_for
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
