"""Plans that stay right (issue 34): the conditions of a calibration, the check of the
plan against answers, re-pricing and the switch, the plan log; on recorded costs (from
this machine: a calibration beside another llama.cpp decode, and a quiet one), never on
how busy the test machine is. The engine's part runs the real model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.stats import StepStats
from engine.drafters import DEFAULT_EAGLE3_HEAD, DEFAULT_HEAD_DIR
from engine.planning.calibration import CalibrationCache, CostProfile, cache_key, repeat_spread
from engine.planning.machine_load import LoadMeter, LoadReading
from engine.planning.plan_check import PlanCheck, reprice
from engine.planning.plan_log import PlanLog
from engine.planning.planner import HeadFacts, Plan, choose_plan
from engine.runtime.hardware import load_profile, probe_hardware
from engine.runtime.model_info import ModelFacts
from tests.conftest import PROFILES

MS = 0.001
QUIET_RATIOS = {1: 1.0, 2: 1.38, 3: 1.76, 4: 2.0, 5: 2.41, 6: 2.75, 7: 3.14, 8: 3.47,
                9: 3.89, 12: 4.93, 16: 6.04, 24: 9.28, 33: 12.56}
# Measured beside another 2-thread decode: slow, flat (batches look free), unstable.
BUSY_CURVE = {1: 127, 2: 127, 3: 127, 4: 130, 5: 200, 6: 200, 7: 250, 8: 250, 9: 300,
              12: 400, 16: 500, 24: 700, 33: 900}
ACCEPTANCE = (0.2848, 0.3968, 0.4971, 0.4713, 0.3171, 0.5385)  # the bundled head's


def _quiet(t1_ms: float = 13.4, spread: float = 0.04, head_ms: tuple[float, float] = (3.26, 3.58)
           ) -> CostProfile:
    return CostProfile(verify_s={"cpu": {n: t1_ms * r * MS for n, r in QUIET_RATIOS.items()}},
                       head_level_s={"cpu": head_ms[0] * MS},
                       head_update_s={"cpu": head_ms[1] * MS},
                       transfer_s={"cpu": 0.0}, measured_at=1.8e9, others_cores=0.01,
                       spread=spread)


def _busy() -> CostProfile:
    return CostProfile(verify_s={"cpu": {n: t * MS for n, t in BUSY_CURVE.items()}},
                       head_level_s={"cpu": 3.5 * MS}, head_update_s={"cpu": 3.6 * MS},
                       transfer_s={"cpu": 0.0}, measured_at=1.8e9, others_cores=1.1,
                       busy=True, spread=0.53)


def _price(costs: CostProfile) -> Plan:
    hw = load_profile(PROFILES / "this_machine_2core.json")
    model = ModelFacts(size_bytes=90_000_000, n_layers=30)
    return choose_plan(hw, costs, model, HeadFacts(250_000_000, ACCEPTANCE))


def _steps(t1_ms: float, n: int = 40, batch2_ms: float | None = None, draft_ms: float = 0.0
           ) -> list[StepStats]:
    """An answer's steps at a short context: plain steps, and some of 2 tokens."""
    steps = [StepStats(draft_ms * MS, t1_ms * MS, 0, 0, n_past=100 + i,
                       drafter_asked=draft_ms > 0) for i in range(n)]
    if batch2_ms is not None:
        steps += [StepStats(draft_ms * MS, batch2_ms * MS, 1, 0, n_past=200 + i,
                            drafter_asked=True) for i in range(6)]
    return steps


def _spot(t1_ms: float):
    return lambda: {n: t1_ms * QUIET_RATIOS[n] * MS for n in (1, 2, 4, 8)}


def test_a_busy_or_unstable_measurement_is_provisional_and_says_so():
    assert not _quiet().provisional and "quiet machine" in _quiet().conditions()
    busy = _busy()
    assert busy.provisional
    text = busy.conditions()
    assert "busy" in text and "1.1 cores" in text and "provisional" in text
    assert _quiet(spread=0.3).provisional  # quiet, but its repeats disagreed
    # Entries cached before the conditions were kept read as they were: not provisional.
    old = {k: v for k, v in _quiet().to_json().items()
           if k not in ("measured_at", "others_cores", "busy", "spread")}
    assert not CostProfile.from_json(old).provisional
    assert CostProfile.from_json(busy.to_json()) == busy


def test_busy_means_more_than_the_cores_the_target_leaves_free():
    assert not LoadReading(0.2, 1.0, spare_cores=0).busy  # background noise
    assert LoadReading(1.0, 1.0, spare_cores=0).busy  # a second decode on 2 cores
    assert not LoadReading(1.0, 1.0, spare_cores=2).busy  # on cores the target leaves free
    with LoadMeter(2) as meter:
        pass
    assert meter.reading is not None and meter.reading.others_cores >= 0


def test_the_spread_of_repeats():
    assert repeat_spread([[1.0, 1.0, 1.0, 1.0]]) == 0
    assert repeat_spread([[1.0, 2.0, 3.0, 4.0, 5.0]]) == pytest.approx(2 / 3)
    assert repeat_spread([[1.0, 2.0]]) == 0  # too few repeats to say


def test_the_busy_plan_heals_after_one_quiet_answer():
    busy = _busy()
    plan = _price(busy)
    assert plan.drafter == "head"  # flat batches made the head look worth it
    check = PlanCheck(busy, plan, _price)
    # A quiet answer: the governor paused the head (plain steps), drafts cost ~5 ms.
    change = check.observe(_steps(12.8, draft_ms=4.9), _spot(13.0))
    assert change is not None  # provisional costs: one answer is enough
    assert change.new.drafter == "memory" and change.old.drafter == "head"
    assert "12.8 ms" in change.why and "127.0 ms" in change.why
    assert check.plan is change.new and check.changes == [change]
    # Measured again on the answers' costs, the next answer agrees: no second switch.
    assert check.observe(_steps(13.0)) is None and len(check.changes) == 1


def test_a_quiet_calibration_needs_two_disagreeing_answers_in_a_row():
    quiet = _quiet(head_ms=(0.5, 0.5))  # a head cheap enough to pay if batches were
    plan = _price(quiet)
    assert plan.drafter == "memory"
    check = PlanCheck(quiet, plan, _price)
    assert check.answers_needed == 2
    # Batches of 2 verified at nearly one token's cost (as if a faster kernel came in):
    # the spot check finds every size cheap, and the head would pay.
    cheap = {n: 13.0 * MS * (1 + 0.02 * (n - 1)) for n in (1, 2, 4, 8)}
    answer = _steps(13.0, batch2_ms=13.3)
    assert check.observe(answer, lambda: cheap) is None and check.streak == 1
    assert check.observe(_steps(13.2)) is None and check.streak == 0  # agreed: start again
    assert check.observe(answer, lambda: cheap) is None
    change = check.observe(answer, lambda: cheap)
    assert change is not None and change.new.drafter == "head"


def test_answers_within_the_noise_change_nothing_and_spot_check_nothing():
    quiet = _quiet()
    check = PlanCheck(quiet, _price(quiet), _price)

    def no_spot_check() -> dict[int, float]:
        raise AssertionError("no extra measurement when the answer agrees")

    for t1 in (12.0, 13.4, 14.9):  # within 15% either way
        assert check.observe(_steps(t1, batch2_ms=t1 * 1.4), no_spot_check) is None
    assert check.last_verdict == "answers agree with the measured costs"
    # A slower machine that does not change the choice is not a switch either.
    assert check.observe(_steps(20.0), _spot(20.0)) is None
    assert "still holds" in check.last_verdict and not check.changes
    # Steps at a longer context are not compared with a 256-token calibration.
    far = [StepStats(0, 0.05, 0, 0, n_past=3000) for _ in range(10)]
    assert check.observe(far) is None and "nothing comparable" in check.last_verdict


def test_repricing_keeps_the_costs_it_did_not_see():
    busy = _busy()
    plan = _price(busy)
    factors = {1: 0.1, 2: 0.14}
    out = reprice(busy, factors, None, plan)
    curve = out.verify_s["cpu"]
    assert curve[1] == pytest.approx(12.7 * MS) and curve[2] == pytest.approx(127 * 0.14 * MS)
    assert list(curve.values()) == sorted(curve.values())  # never cheaper for more tokens
    assert out.head_level_s == busy.head_level_s  # the head did not run: kept as measured
    running = reprice(busy, factors, 1.5, plan)
    assert running.head_level_s["cpu"] == pytest.approx(1.5 * busy.head_level_s["cpu"])
    assert not out.provisional


def test_the_plan_log_keeps_the_last_changes(tmp_path: Path):
    log = PlanLog(tmp_path)
    assert log.events("k") == []
    log.record("k", "plain", "costs measured for the first time")
    log.record("k", "cpu: head", "costs measured again, as asked")
    events = log.events("k")
    assert [e.plan for e in events] == ["plain", "cpu: head"]
    assert events[-1].describe().endswith("costs measured again, as asked")
    for i in range(30):
        log.record("k", f"p{i}", "why")
    assert len(log.events("k")) == 20
    log.path.write_text("{not json")
    assert log.events("k") == []  # a damaged log is an empty one
    log.record("k", "plain", "again")
    assert len(log.events("k")) == 1


# --- the engine, on the real model -----------------------------------------------------
def _seed(cache_dir: Path, costs: CostProfile, model_path: Path, monkeypatch,
          busy_now: bool) -> None:
    """Put ``costs`` in the cache under the key the engine will use (the bundled head,
    2 threads, the target on the CPU), and set how busy the machine looks at start."""
    import engine.planning.plan_maker as session

    reading = LoadReading(2.0 if busy_now else 0.0, 0.3, 0)
    monkeypatch.setattr(session, "look_at_load", lambda _threads: reading)
    key = cache_key(probe_hardware().fingerprint(), model_path, DEFAULT_HEAD_DIR, 2,
                    ("cpu",), ("cpu",), eagle3=DEFAULT_EAGLE3_HEAD)
    CalibrationCache(cache_dir).put(key, costs)


def _open(model_path: Path, cache_dir: Path):
    from engine.session import Engine, EngineConfig

    return Engine(EngineConfig(model_path=model_path, drafter="auto", n_threads=2,
                               n_ctx=1024, cache_dir=cache_dir,
                               memory_dir=cache_dir / "memory"))


def test_provisional_costs_are_kept_while_busy_and_measured_again_when_quiet(
        model_path: Path, tmp_path: Path, monkeypatch):
    """Each outcome pinned: the measurements come from the test (a busy one, then a quiet
    one), not from this machine's load at the time."""
    import engine.planning.plan_maker as plan_maker

    quiet = replace(_busy(), busy=False, others_cores=0.05, spread=0.02)
    measured: list[CostProfile] = []

    def measure(self, target, config, say):  # noqa: ANN001
        return measured.pop(0)

    monkeypatch.setattr(plan_maker.PlanMaker, "measure", measure)
    _seed(tmp_path, _busy(), model_path, monkeypatch, busy_now=True)
    with _open(model_path, tmp_path) as engine:
        assert not engine.calibrated_now and engine.costs.provisional
        assert engine.remeasure_wanted
        status = engine.plan_status()
        assert status["provisional"] and "busy" in status["costs"]
        # What the app does when idle: measure again. A busy result replaces nothing...
        measured.append(_busy())
        assert not engine.remeasure()
        assert engine.remeasure_wanted
        assert CalibrationCache(tmp_path).get(engine.plans.cache_key) == _busy()
        # ...a quiet one replaces the cache, and the plan check prices with it.
        measured.append(quiet)
        engine.remeasure()
        assert not engine.remeasure_wanted
        assert CalibrationCache(tmp_path).get(engine.plans.cache_key) == quiet
        assert engine.costs == quiet and engine.plan_check.costs is engine.costs
    # Busy costs in the cache and a quiet machine at start: measured again at once.
    CalibrationCache(tmp_path).put(engine.plans.cache_key, _busy())
    monkeypatch.setattr(plan_maker, "look_at_load", lambda _t: LoadReading(0.0, 0.3, 0))
    measured.append(quiet)
    with _open(model_path, tmp_path) as engine:
        assert engine.calibrated_now and engine.costs == quiet
        assert engine.plans.start_why == "costs measured again on a quiet machine"
        assert not engine.remeasure_wanted


def test_a_switched_plan_runs_its_drafter_and_output_stays_the_targets(
        model_path: Path, tmp_path: Path, target, monkeypatch):
    """Provisional busy costs (the head looked worth it), then a first answer on this
    machine: one answer is enough to switch, and the switch is pinned by what the check
    measures between answers, this machine's quiet curve (recorded), instead of a spot
    check under whatever else runs here. Re-priced on that curve the head does not pay
    however cheap its steps (a 0.5 ms level still plans memory, above), so the plan
    switches to drafts from memory. Every answer is the target's; the head's drafts were
    rejected, and once the memory holds the answer its drafts are accepted."""
    import engine.planning.plan_maker as plan_maker

    quiet_curve = {n: 13.4 * r * MS for n, r in QUIET_RATIOS.items()}
    monkeypatch.setattr(plan_maker, "spot_check", lambda *_args, **_kw: dict(quiet_curve))
    _seed(tmp_path, _busy(), model_path, monkeypatch, busy_now=True)
    # Extraction: the answer copies the prompt, so the head and memory have text to draft.
    prompt = target.chat_prompt([{"role": "user", "content": EXTRACTION}])
    target.reset()
    target.set_features(False)
    plain = generate(target, prompt, None, GenerationConfig(24)).tokens
    with _open(model_path, tmp_path) as engine:
        assert engine.plan.drafter == "head" and engine.drafter_name == "head+memory"
        assert engine.governor is not None
        first = engine.generate(prompt, GenerationConfig(24))
        assert first.tokens == plain
        # The head guessed before the costs learnt this machine's (its first steps are
        # priced by the recorded flat curve), and guessed wrong.
        assert _rejected(first) > 0
        # Recorded at 127 ms a token, answered far faster: the check disagreed, and with
        # provisional costs this one answer switched the plan.
        assert "agree" not in engine.plan_check.last_verdict
        [change] = engine.plan_check.changes
        assert (change.old.drafter, change.new.drafter) == ("head", "memory")
        assert engine.plan is change.new and engine.drafter_name == "memory"
        assert engine.plan_events[-1].why == change.why
        assert engine.remeasure_wanted
        # The switches below are the test's own: answers timed under this machine's load
        # must not switch the plan between them.
        engine.plan_check = None
        # Verification priced by a fixed curve from here: learnt from decodes beside
        # another process, the budget declined every memory draft (0 proposed in 16 steps).
        engine.cost = VerifyCostModel(slope=0.35, learn=False)
        # Each plan runs its own drafter, and the output stays the target's.
        engine.apply_plan(_price(_busy()), "test: the head")
        assert engine.drafter_name == "head+memory" and engine.governor is not None
        # The memory holds the first answer to this question: it drafts this one.
        again = engine.generate(prompt, GenerationConfig(24))
        assert again.tokens == plain and _accepted(again) > 0
        engine.apply_plan(_price(_quiet()), "test: memory")
        assert engine.drafter_name == "memory" and engine.governor is not None
        assert engine.plan_events[-1].why == "test: memory"
        last = engine.generate(prompt, GenerationConfig(24))
        assert last.tokens == plain and _accepted(last) > 0
        log = json.loads((tmp_path / "plan_log.json").read_text())
        assert log[engine.plans.cache_key][-1]["plan"] == engine.plan.layout_text()


EXTRACTION = ("Copy the list exactly as written: apples, pears, plums, apples, pears, plums, "
              "apples, pears, plums.")


def _accepted(result) -> int:  # noqa: ANN001
    return sum(s.n_accepted for s in result.stats.steps)


def _rejected(result) -> int:  # noqa: ANN001
    return sum(s.n_proposed - s.n_accepted for s in result.stats.steps)
