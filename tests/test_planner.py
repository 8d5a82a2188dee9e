"""Plan choices for recorded hardware profiles and cost curves, through the real planner.

``*_2core`` files were recorded on this machine by ``tandem plan --json``. The
``synthetic_*`` files are invented, not measured: machines and cost curves of the shape
calibration would record there (a memory-bound target costs little more for a batch of a
few tokens), to test that the plan follows from the costs given."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.planning.calibration import CostProfile
from engine.planning.planner import (
    HeadFacts,
    MtpFacts,
    Overrides,
    choose_plan,
    expected_tokens,
)
from engine.runtime.hardware import load_profile
from engine.runtime.model_info import ModelFacts
from tests.conftest import PROFILES

GB = 1024**3
HEAD = HeadFacts(size_bytes=200 * 1024**2, acceptance=(0.7, 0.65, 0.6, 0.6, 0.55, 0.55))


def costs(name: str) -> CostProfile:
    return CostProfile.from_json(json.loads((PROFILES / f"{name}.json").read_text()))


def test_expected_tokens_counts_the_bonus_and_chains_the_acceptance():
    assert expected_tokens((0.5,), 0) == 1.0
    assert expected_tokens((0.5, 0.5), 2) == pytest.approx(1 + 0.5 + 0.25)


def test_this_machine_decodes_plainly_because_the_head_costs_more_than_it_saves():
    smollm = ModelFacts(size_bytes=int(0.09 * GB), n_layers=30)
    head = HeadFacts(size_bytes=230 * 1024**2, acceptance=(0.45, 0.4, 0.38))
    plan = choose_plan(load_profile(PROFILES / "this_machine_2core.json"),
                       costs("costs_this_machine_2core"), smollm, head)
    assert plan.layout == "plain" and plan.drafter == "memory"
    head_options = [c for c in plan.candidates if c.drafter == "head"]
    assert head_options and all(c.tok_per_s < plan.plain_tok_per_s for c in head_options)
    assert "costs more than it saves" in plan.reason


def test_cpu_laptop_with_a_bigger_model_drafts_on_the_cpu():
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24)
    plan = choose_plan(load_profile(PROFILES / "synthetic_cpu_only_laptop.json"),
                       costs("synthetic_costs_laptop_cpu_1p7b"), model, HEAD)
    assert (plan.layout, plan.drafter, plan.head_device) == ("cpu", "head", "cpu")
    assert plan.target_gpu_layers == 0
    assert plan.budget.depth >= 3  # verification is nearly flat: draft deep
    assert plan.predicted_speedup > 1.5
    assert [c.layout for c in plan.candidates] == ["plain", "cpu"]  # no GPU layouts


def test_laptop_with_4gb_gpu_runs_dovetail_with_spare_vram_for_target_layers():
    model = ModelFacts(size_bytes=int(4.1 * GB), n_layers=32, kv_bytes=int(0.5 * GB))
    plan = choose_plan(load_profile(PROFILES / "synthetic_laptop_4gb_gpu.json"),
                       costs("synthetic_costs_laptop_gpu_7b"), model, HEAD)
    assert plan.layout == "dovetail" and plan.head_device == "cuda:0"
    # The target does not fit in 3.6 GB, but part of it does next to the head.
    assert 0 < plan.target_gpu_layers < 32
    assert "duodecoding" not in {c.layout for c in plan.candidates}
    assert plan.predicted_speedup > 2


def test_large_gpu_takes_target_and_head_when_head_levels_are_cheap_there():
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24, kv_bytes=int(0.4 * GB))
    plan = choose_plan(load_profile(PROFILES / "synthetic_large_gpu.json"),
                       costs("synthetic_costs_large_gpu_1p7b"),
                       model, HEAD)
    layouts = {c.layout for c in plan.candidates}
    assert {"plain", "cpu", "dovetail", "duodecoding"} <= layouts
    # 0.5 ms per head level on the GPU: taking turns there beats a 1.5 ms CPU draft
    # that only overlaps when it guessed the whole step.
    assert plan.layout == "dovetail" and plan.head_device == "cuda:0"
    assert plan.target_gpu_layers == -1
    # Plain decoding is judged on the GPU too (the fair baseline).
    assert plan.plain_tok_per_s == pytest.approx(1 / 0.006)


def test_large_gpu_with_launch_bound_head_overlaps_a_cpu_draft():
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24, kv_bytes=int(0.4 * GB))
    measured = costs("synthetic_costs_large_gpu_1p7b")
    slow_gpu_head = replace(measured, head_level_s={**measured.head_level_s, "cuda:0": 0.003},
                            head_update_s={**measured.head_update_s, "cuda:0": 0.004})
    plan = choose_plan(load_profile(PROFILES / "synthetic_large_gpu.json"), slow_gpu_head,
                       model, HEAD)
    assert plan.layout == "duodecoding"
    assert plan.target_gpu_layers == -1 and plan.head_device == "cpu"
    assert plan.budget.mode == "multi"
    assert plan.predicted_speedup > 1.05


def test_llama_cpp_without_offload_keeps_the_target_on_the_cpu():
    model = ModelFacts(size_bytes=int(4.1 * GB), n_layers=32)
    hw = load_profile(PROFILES / "synthetic_gpu_no_offload.json")
    plan = choose_plan(hw, costs("synthetic_costs_laptop_gpu_7b"), model, HEAD)
    assert plan.layout == "dovetail" and plan.target_gpu_layers == 0
    with pytest.raises(ValueError, match="cannot offload"):
        choose_plan(hw, costs("synthetic_costs_laptop_gpu_7b"), model, HEAD,
                    Overrides(layout="duodecoding"))


def test_overrides_win_and_are_explained():
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24)
    hw = load_profile(PROFILES / "synthetic_cpu_only_laptop.json")
    c = costs("synthetic_costs_laptop_cpu_1p7b")
    plain = choose_plan(hw, c, model, HEAD, Overrides(layout="plain"))
    assert plain.layout == "plain" and "as you asked" in plain.reason
    shallow = choose_plan(hw, c, model, HEAD, Overrides(max_draft=2, depth=2))
    assert shallow.budget.depth <= 2 and shallow.budget.max_draft <= 2
    off = choose_plan(hw, c, model, HEAD, Overrides(drafter="none"))
    assert off.drafter == "none" and off.budget.max_draft == 0
    with pytest.raises(ValueError):
        Overrides(layout="sideways")


def test_no_head_means_plain_decoding_with_drafts_from_memory():
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24)
    plan = choose_plan(load_profile(PROFILES / "synthetic_large_gpu.json"),
                       costs("synthetic_costs_large_gpu_1p7b"),
                       model, None)
    assert (plan.layout, plan.drafter) == ("plain", "memory")
    assert plan.target_gpu_layers == -1  # plain decoding still uses the GPU
    assert "no draft head" in plan.reason


def test_plan_round_trips_to_json_for_the_gui():
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24)
    plan = choose_plan(load_profile(PROFILES / "synthetic_cpu_only_laptop.json"),
                       costs("synthetic_costs_laptop_cpu_1p7b"), model, HEAD)
    data = json.loads(json.dumps(plan.to_json()))
    assert data["layout"] == "cpu" and data["budget"]["depth"] == plan.budget.depth
    assert "draft head on cpu" in data["layout_text"]
    assert "Why:" in plan.describe()


def test_a_gpu_whose_batches_differ_from_single_tokens_verifies_nothing():
    """Where the exactness probe finds the GPU-resident target's verified batches unlike its
    one-token decoding (CUDA picks another matrix kernel by batch size), no draft is
    verified by target layers on the GPU: the head may still draft there (Dovetail with
    the target wholly on the CPU), and a GPU-resident target decodes plainly."""
    hw = load_profile(PROFILES / "synthetic_large_gpu.json")
    exact = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24, kv_bytes=int(0.4 * GB))
    inexact = replace(exact, exact_on_gpu=False)
    measured = costs("synthetic_costs_large_gpu_1p7b")
    assert choose_plan(hw, measured, exact, HEAD).target_gpu_layers == -1  # as before
    plan = choose_plan(hw, measured, inexact, HEAD)
    for c in plan.candidates:
        if c.target_gpu_layers != 0:
            assert c.budget.max_draft == 0, c
    assert "duodecoding" not in {c.layout for c in plan.candidates}
    dovetail = [c for c in plan.candidates if c.layout == "dovetail"]
    assert dovetail and all(c.target_gpu_layers == 0 and c.head_device == "cuda:0"
                            for c in dovetail)
    if plan.target_gpu_layers != 0:
        assert plan.budget.max_draft == 0
    no_head = choose_plan(hw, measured, inexact, None)
    assert no_head.target_gpu_layers == -1 and no_head.budget.max_draft == 0


def test_a_hybrids_draft_cap_is_in_the_plan():
    """Recurrent state takes back 8 draft tokens at most: every candidate's budget, and so
    the plan the window shows, stays within it."""
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24, kv_bytes=int(0.4 * GB),
                       max_draft=8)
    for profile, cost in (("synthetic_large_gpu", "synthetic_costs_large_gpu_1p7b"),
                          ("synthetic_cpu_only_laptop", "synthetic_costs_laptop_cpu_1p7b")):
        plan = choose_plan(load_profile(PROFILES / f"{profile}.json"), costs(cost), model, HEAD)
        assert all(c.budget.max_draft <= 8 for c in plan.candidates), profile
        assert plan.budget.max_draft <= 8
    uncapped = choose_plan(load_profile(PROFILES / "synthetic_large_gpu.json"),
                           costs("synthetic_costs_large_gpu_1p7b"), replace(model, max_draft=None),
                           None)
    assert uncapped.budget.max_draft > 8  # drafts from memory: 32 without the cap


def test_an_mtp_block_is_priced_from_its_measured_level_and_chosen_when_it_pays():
    """A 1.7B-shaped CPU laptop: verification nearly flat. A block whose level costs a
    tenth of a token drafts; one that costs as much as a token does not pay."""
    model = ModelFacts(size_bytes=int(1.0 * GB), n_layers=24)
    hw = load_profile(PROFILES / "synthetic_cpu_only_laptop.json")
    base = costs("synthetic_costs_laptop_cpu_1p7b")
    token_s = base.verify("cpu", 1)
    cheap = replace(base, mtp_level_s={"cpu": 0.1 * token_s},
                    mtp_update_s={"cpu": 0.15 * token_s})
    plan = choose_plan(hw, cheap, model, None, mtp=MtpFacts())
    assert (plan.layout, plan.drafter, plan.head_device) == ("cpu", "mtp", "cpu")
    assert plan.budget.depth >= 2 and plan.predicted_speedup > 1.3
    assert "MTP block" in plan.reason and "prior" in plan.reason
    dear = replace(base, mtp_level_s={"cpu": token_s}, mtp_update_s={"cpu": token_s})
    plan = choose_plan(hw, dear, model, None, mtp=MtpFacts())
    assert plan.drafter == "memory"
    assert any(c.drafter == "mtp" for c in plan.candidates)
    # Not measured (costs from before the block was priced): not offered at all.
    plan = choose_plan(hw, base, model, None, mtp=MtpFacts())
    assert not any(c.drafter == "mtp" for c in plan.candidates)


def test_a_sparse_verify_curve_is_read_between_its_points():
    """A curve measured at 1, 2, 4, 8, 16 (a GPU session's) prices 3 between 2 and 4, not
    on the line through 8 and 16; beyond the last size it goes on along the last two."""
    costs = CostProfile(verify_s={"cpu": {1: 0.076, 2: 0.136, 4: 0.206, 8: 0.391, 16: 0.771}})
    assert costs.verify("cpu", 3) == pytest.approx((0.136 + 0.206) / 2)
    assert costs.verify("cpu", 12) == pytest.approx((0.391 + 0.771) / 2)
    assert costs.verify("cpu", 20) == pytest.approx(0.771 + 4 * (0.771 - 0.391) / 8)
    assert CostProfile(verify_s={"cpu": {1: 0.05}}).verify("cpu", 4) == 0.05
