"""The first start's measurement reports how far it is (engine.planning.measure_progress):
weighted steps, the time left at the pace so far, values that travel to an engine
process's parent, a real measurement's reports rising to done, and the CLI's lines."""

from __future__ import annotations

import pickle

import pytest

from app.cli.common import LoadProgress
from engine.planning.calibration import calibrate
from engine.planning.measure_progress import MEASURED, MeasureSteps, Measuring


def test_a_measuring_value_is_text_with_how_far_and_the_time_left() -> None:
    value = Measuring("target verification cost", 0.25, 10.0)
    assert value == "target verification cost" and value[:6] == "target"  # text as before
    assert value.seconds_left == pytest.approx(30.0)  # 10 s for a quarter: 30 s to go
    assert Measuring("x", 0.0, 5.0).seconds_left is None  # nothing done: no estimate
    assert Measuring("x", 1.0, 5.0).seconds_left == 0.0
    assert Measuring("x", 1.7, -1.0).done == 1.0  # clamped
    again = pickle.loads(pickle.dumps(value))  # as an engine process sends it
    assert isinstance(again, Measuring) and again == value
    assert (again.done, again.elapsed_s) == (0.25, 10.0)


def test_steps_are_weighted_and_end_at_done() -> None:
    seen: list[Measuring] = []
    steps = MeasureSteps(seen.append, [3.0, 1.0])
    steps.begin("first")
    steps.part(0.5)
    steps.begin("second")
    steps.part(1.0)
    steps.begin("unplanned")  # counts for nothing
    steps.finish()
    assert [str(v) for v in seen] == ["first", "first", "second", "second", "unplanned",
                                      MEASURED]
    assert [v.done for v in seen] == pytest.approx([0.0, 0.375, 0.75, 1.0, 1.0, 1.0])


def test_a_real_measurement_reports_rising_progress_ending_at_done(target) -> None:  # noqa: ANN001
    seen: list[str] = []
    after: list[str] = []
    calibrate(target, None, ["cpu"], progress=seen.append,
              then=[("what the caller measures after", lambda _c: after.append("ran"))])
    assert after == ["ran"]
    assert all(isinstance(v, Measuring) for v in seen)
    done = [v.done for v in seen]
    assert done == sorted(done) and done[0] == 0.0 and done[-1] == 1.0
    assert any(0.0 < d < 1.0 for d in done)  # the verification's rounds move the bar
    assert seen[-1] == MEASURED
    assert "target verification cost" in seen and "what the caller measures after" in seen
    elapsed = [v.elapsed_s for v in seen]
    assert elapsed == sorted(elapsed)


def test_the_cli_prints_a_line_per_step_where_stderr_is_no_terminal(capsys) -> None:  # noqa: ANN001
    progress = LoadProgress()
    progress("checking that verified batches match one-token decoding")
    for what, done in [("target verification cost", 0.0), ("target verification cost", 0.3),
                       ("draft head on cpu", 0.5), (MEASURED, 1.0)]:
        progress(Measuring(what, done, 1.0))
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["tandem: checking that verified batches match one-token decoding...",
                     "tandem: target verification cost...", "tandem: draft head on cpu...",
                     f"tandem: {MEASURED}..."]
    assert progress.bar is None
