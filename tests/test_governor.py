"""The speculation governor: drafting stops while it loses time and comes back when it
pays; losing probes stay under ~1% of the time."""

from __future__ import annotations

from engine.decoding.budget import SpeculationGovernor

T1 = 0.008  # seconds per plain token


def _run(gov: SpeculationGovernor, steps: int, accepted: int, t_draft: float,
         t_verify: float) -> tuple[int, float]:
    """Drafting steps taken and the time they lost against plain decoding."""
    drafted, lost = 0, 0.0
    for _ in range(steps):
        if gov.should_draft():
            drafted += 1
            gov.observe(accepted, t_draft, t_verify, T1)
            lost += t_draft + t_verify - (1 + accepted) * T1
    return drafted, lost


def test_a_drafter_that_pays_keeps_drafting():
    gov = SpeculationGovernor()
    drafted, _ = _run(gov, 200, accepted=2, t_draft=0.002, t_verify=1.4 * T1)
    assert drafted == 200 and gov.n_paused == 0


def test_a_drafter_that_loses_is_paused_and_its_probes_cost_little():
    gov = SpeculationGovernor()
    steps = 2000
    drafted, lost = _run(gov, steps, accepted=0, t_draft=0.02, t_verify=1.6 * T1)
    assert drafted < 0.02 * steps
    # Time lost to probes, against plain decoding of all the steps: about 1%.
    assert lost / (steps * T1) < 0.03


def test_drafting_resumes_when_it_pays_again():
    gov = SpeculationGovernor()
    _run(gov, 50, accepted=0, t_draft=0.004, t_verify=1.5 * T1)
    assert gov.pause_left > 0
    pause = gov.pause_left
    drafted, _ = _run(gov, pause + 600, accepted=3, t_draft=0.002, t_verify=1.5 * T1)
    assert drafted == 600  # every step after the pause drafts again


def test_a_new_prompt_ends_the_pause_of_drafts_read_from_the_context():
    """A tool loop's next answer repeats a call or quotes a result the last answer never
    saw: drafters that read the context are probed again at once (a probe's few steps),
    a draft model keeps its pause."""
    looks_back = SpeculationGovernor(tolerance=0.05, max_pause=32, resume_on_new_request=True)
    model = SpeculationGovernor()
    for gov in (looks_back, model):
        _run(gov, 8, accepted=0, t_draft=0.0001, t_verify=1.8 * T1)
        assert gov.pause_left > 0
        gov.new_request()
    assert looks_back.pause_left == 0 and looks_back.should_draft()
    assert model.pause_left > 0 and not model.should_draft()
    # The probe that follows is short: three losing steps pause it again.
    drafted, _ = _run(looks_back, 10, accepted=0, t_draft=0.0001, t_verify=1.8 * T1)
    assert drafted == 3 and looks_back.pause_left > 0
