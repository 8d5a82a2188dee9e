"""The planner prices draft models like heads, and a pair's record corrects the prior.

Pure: recorded hardware profiles and cost curves (the ``synthetic_*`` ones are invented,
see test_planner.py) with a draft model's per-token cost added."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.decoding.stats import StepStats
from engine.planning.calibration import CostProfile
from engine.planning.draft_record import PRIOR_STEPS, DraftRecord, depth_counts
from engine.planning.planner import (
    DRAFT_MODEL_ACCEPTANCE,
    DraftModelFacts,
    Overrides,
    choose_plan,
)
from engine.runtime.hardware import load_profile
from engine.runtime.model_info import ModelFacts
from tests.conftest import PROFILES
from tests.test_planner import HEAD, costs

GB = 1024**3
MODEL_1P7B = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24)
MODEL_7B = ModelFacts(size_bytes=int(4.1 * GB), n_layers=32, kv_bytes=int(0.5 * GB))
DRAFT = DraftModelFacts("Qwen2.5-0.5B-Instruct-Q8_0.gguf", int(0.5 * GB), int(0.05 * GB))


def with_draft(profile: CostProfile, token_s: float, sync_s: float = 0.0,
               device: str = "cpu") -> CostProfile:
    return replace(profile, draft_token_s={device: token_s}, draft_sync_s={device: sync_s})


def test_a_cheap_draft_model_drafts_beside_a_cpu_target():
    hw = load_profile(PROFILES / "synthetic_cpu_only_laptop.json")
    c = with_draft(costs("synthetic_costs_laptop_cpu_1p7b"), 0.004, 0.002)  # 45 ms target
    plan = choose_plan(hw, c, MODEL_1P7B, None, draft=DRAFT)
    assert (plan.layout, plan.drafter, plan.head_device) == ("cpu", "draft", "cpu")
    assert plan.budget.mode == "multi" and plan.budget.depth >= 3
    assert plan.predicted_speedup > 1.5
    assert DRAFT.name in plan.reason and "prior" in plan.reason
    assert "draft model on cpu" in plan.layout_text()


def test_a_draft_model_half_as_slow_as_the_target_does_not_pay():
    hw = load_profile(PROFILES / "synthetic_cpu_only_laptop.json")
    c = with_draft(costs("synthetic_costs_laptop_cpu_1p7b"), 0.0225, 0.01)
    plan = choose_plan(hw, c, MODEL_1P7B, None, draft=DRAFT)
    assert (plan.layout, plan.drafter) == ("plain", "memory")
    drafts = [x for x in plan.candidates if x.drafter == "draft"]
    assert drafts and all(x.tok_per_s < 1.05 * plan.plain_tok_per_s for x in drafts)
    assert "draft-model layout" in plan.reason and "costs more than it saves" in plan.reason


def test_the_acceptance_decides_between_draft_model_and_plain():
    hw = load_profile(PROFILES / "synthetic_cpu_only_laptop.json")
    c = with_draft(costs("synthetic_costs_laptop_cpu_1p7b"), 0.009, 0.004)
    good = choose_plan(hw, c, MODEL_1P7B, None, draft=replace(DRAFT, acceptance=(0.85,) * 8))
    bad = choose_plan(hw, c, MODEL_1P7B, None, draft=replace(DRAFT, acceptance=(0.2,) * 8))
    assert good.drafter == "draft" and bad.drafter == "memory"


def test_a_small_gpu_takes_the_draft_model_and_the_target_stays_on_the_cpu():
    # A 7B that does not fit in 3.6 GB: the draft model goes to the GPU (cost estimated
    # from the CPU's, as nothing was measured there) with target layers in what is left.
    hw = load_profile(PROFILES / "synthetic_laptop_4gb_gpu.json")
    c = with_draft(costs("synthetic_costs_laptop_gpu_7b"), 0.03, 0.01)
    plan = choose_plan(hw, c, MODEL_7B, None, draft=DRAFT)
    assert (plan.layout, plan.drafter, plan.head_device) == ("dovetail", "draft", "cuda:0")
    assert 0 < plan.target_gpu_layers < 32
    assert "estimated" in plan.reason
    assert "duodecoding" not in {x.layout for x in plan.candidates}


def test_without_gpu_offload_a_draft_model_stays_on_the_cpu():
    hw = load_profile(PROFILES / "synthetic_gpu_no_offload.json")
    c = with_draft(costs("synthetic_costs_laptop_gpu_7b"), 0.03, 0.01)
    plan = choose_plan(hw, c, MODEL_7B, None, draft=DRAFT)
    assert {x.layout for x in plan.candidates if x.drafter == "draft"} == {"cpu"}


def test_head_and_draft_model_compete_and_the_faster_wins():
    hw = load_profile(PROFILES / "synthetic_cpu_only_laptop.json")
    base = costs("synthetic_costs_laptop_cpu_1p7b")
    slow_draft = choose_plan(hw, with_draft(base, 0.02, 0.01), MODEL_1P7B, HEAD, draft=DRAFT)
    fast_draft = choose_plan(hw, with_draft(base, 0.001, 0.0005), MODEL_1P7B, HEAD,
                             draft=replace(DRAFT, acceptance=(0.9,) * 8))
    assert slow_draft.drafter == "head" and fast_draft.drafter == "draft"
    assert {x.drafter for x in fast_draft.candidates} == {"memory", "head", "draft"}
    only_head = choose_plan(hw, with_draft(base, 0.001), MODEL_1P7B, HEAD,
                            Overrides(drafter="head"), draft=DRAFT)
    assert only_head.drafter == "head"
    assert "draft" not in {x.drafter for x in only_head.candidates}


def test_nothing_measured_for_the_draft_model_leaves_it_out():
    hw = load_profile(PROFILES / "synthetic_cpu_only_laptop.json")
    plan = choose_plan(hw, costs("synthetic_costs_laptop_cpu_1p7b"), MODEL_1P7B, None,
                       draft=DRAFT)
    assert "draft" not in {x.drafter for x in plan.candidates}


def test_old_cost_profiles_without_draft_costs_still_load():
    data = costs("synthetic_costs_laptop_cpu_1p7b").to_json()
    del data["draft_token_s"], data["draft_sync_s"]
    assert CostProfile.from_json(data).draft_token_s == {}


def test_depth_counts_follow_accepted_chains():
    steps = [StepStats(0, 0, 4, 4), StepStats(0, 0, 4, 1), StepStats(0, 0, 2, 0),
             StepStats(0, 0, 0, 0)]  # the last proposed nothing: not counted
    reached, accepted = depth_counts(steps)
    assert reached[:5] == [3, 2, 1, 1, 0]
    assert accepted[:5] == [2, 1, 1, 1, 0]


def test_the_record_corrects_the_prior_and_survives_damage(tmp_path):
    record = DraftRecord(tmp_path)
    key = "target.gguf:1|draft.gguf:2"
    prior = DRAFT_MODEL_ACCEPTANCE
    assert record.acceptance(key, prior)[0] == prior
    record.add(key, [StepStats(0, 0, 3, 0)] * PRIOR_STEPS)  # always wrong at depth 1
    rates, source = record.acceptance(key, prior)
    assert rates[0] == pytest.approx(prior[0] / 2)  # the prior and as many steps
    assert rates[1] == prior[1]  # depth 2 never reached: still the prior
    assert f"over {PRIOR_STEPS} drafting steps" in source
    record.add(key, [StepStats(0, 0, 3, 3)] * PRIOR_STEPS * 98)
    assert record.acceptance(key, prior)[0][0] > 0.95
    record.path.write_text("{not json")
    assert record.acceptance(key, prior)[0] == prior
    record.add(key, [StepStats(0, 0, 1, 1)])  # a damaged file is replaced
    assert record.acceptance(key, prior)[1].endswith("over 1 drafting steps with this pair")


# Profiles measured on the 2-core development machine (tandem profile): synthetic GGUFs
# of the real shapes in Q4_0. The plans below are what those measurements imply.
LIKELY = (0.75, 0.72, 0.7, 0.68, 0.66, 0.64, 0.62, 0.6)


def measured(name: str):  # noqa: ANN201
    from engine.planning.measured_profile import load_measured_profile

    return load_measured_profile(PROFILES / f"measured_{name}_epyc_2core.json")


def test_llama_8b_on_two_cores_drafts_with_llama_1b_only_when_the_pair_agrees_often():
    profile = measured("llama-3.1-8b")
    assert profile.drafts[0].shape == "llama-3.2-1b"
    assert profile.drafts[0].token_s < profile.verify_s[256][1] / 4
    at_prior = profile.plan()
    assert at_prior.drafter == "memory"  # ~0.99x: drafting would not repay itself
    likely = profile.plan(LIKELY, head_acceptance=LIKELY)
    assert (likely.layout, likely.drafter) == ("cpu", "draft")
    # A batch of 4 costs less than one of 3 here (llama.cpp's repacked Q4_0 kernels
    # take 4 rows at a time), so the chain stops at 3 drafts plus the target's token.
    assert profile.verify_s[256][4] < profile.verify_s[256][3]
    assert likely.budget.depth == 3 and 1.1 < likely.predicted_speedup < 1.25
    # A float32 head reading a 128k-row LM head every level is far too slow on a CPU.
    heads = [c for c in likely.candidates if c.drafter == "head"]
    assert heads and heads[0].tok_per_s < 0.5 * likely.plain_tok_per_s


def test_qwen_7b_on_two_cores_drafts_with_its_half_billion_sibling_even_at_the_prior():
    profile = measured("qwen2.5-7b")
    plan = profile.plan()
    assert (plan.layout, plan.drafter) == ("cpu", "draft")
    assert plan.predicted_speedup > 1.05
    assert "qwen2.5-0.5b" in plan.reason and "assumed" in plan.reason
