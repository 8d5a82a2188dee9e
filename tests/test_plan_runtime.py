"""The planner on the real engine: calibration and its cache, fallbacks when the GPU is
missing or fails mid-generation (the answer is still exactly the target's)."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.budget import VerifyCostModel
from engine.calibration import CalibrationCache, CostProfile, cache_key
from engine.drafters import DEFAULT_HEAD_DIR, make_drafter
from engine.generation import GenerationConfig, generate
from engine.hardware import load_profile, probe_hardware
from engine.plan_runtime import build_drafter, plan_for, prepare_engine
from engine.planner import LAYOUTS, Overrides
from tests.test_planner import PROFILES

PROMPT = [{"role": "user", "content": "List three uses of a paperclip, one line each."}]


@pytest.fixture(scope="module")
def plain_answer(target):
    target.reset()
    target.set_features(False)
    prompt = target.chat_prompt(PROMPT)
    return prompt, generate(target, prompt, None, GenerationConfig(48)).tokens


def test_calibration_is_measured_once_then_cached(target, tmp_path):
    first = plan_for(target, cache_dir=tmp_path)
    assert first.calibrated_now
    curve = first.costs.verify_s["cpu"]
    assert set(curve) >= {1, 2, 4, 8} and all(t > 0 for t in curve.values())
    assert curve[8] > curve[1]  # verifying more tokens is not free on a CPU
    assert first.costs.head_level_s["cpu"] > 0  # the bundled head was measured
    again = plan_for(target, cache_dir=tmp_path)
    assert not again.calibrated_now and again.costs == first.costs
    assert again.plan.layout in LAYOUTS and again.plan.reason
    fresh = plan_for(target, cache_dir=tmp_path, recalibrate=True)
    assert fresh.calibrated_now


def test_the_cache_key_follows_the_model_file_and_the_head(tmp_path):
    hw = probe_hardware().fingerprint()
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    head = tmp_path / "head"
    shutil.copytree(DEFAULT_HEAD_DIR, head)
    key = cache_key(hw, model, head, 2)
    assert cache_key(hw, model, head, 2) == key
    assert cache_key(hw, model, head, 4) != key
    with model.open("ab") as fh:
        fh.write(b"more")  # a re-downloaded or re-quantized model
    changed = cache_key(hw, model, head, 2)
    assert changed != key
    (head / "head.json").write_text((head / "head.json").read_text() + "\n")
    assert cache_key(hw, model, head, 2) != changed
    cache = CalibrationCache(tmp_path)
    profile = CostProfile(verify_s={"cpu": {1: 0.01, 2: 0.015}})
    cache.put(changed, profile)
    assert cache.get(changed) == profile and cache.get(key) is None


def test_a_missing_gpu_moves_the_head_to_the_cpu(target, plain_answer, tmp_path):
    # A recorded laptop with a CUDA GPU, on this machine where torch has none.
    setup = plan_for(target, overrides=Overrides(layout="dovetail"), cache_dir=tmp_path,
                     hardware=load_profile(PROFILES / "gpu_no_offload.json"))
    assert setup.plan.head_device == "cuda:0"
    drafter, notes = build_drafter(setup, target)
    assert drafter is not None and drafter.name == "head"
    assert drafter.device.type == "cpu"
    assert any("could not run on cuda:0" in n for n in notes)
    prompt, ref = plain_answer
    target.reset()
    assert generate(target, prompt, drafter, GenerationConfig(48)).tokens == ref


def test_a_duodecoding_plan_drafts_ahead_on_the_cpu(target, plain_answer, tmp_path):
    setup = plan_for(target, overrides=Overrides(layout="duodecoding"), cache_dir=tmp_path,
                     hardware=load_profile(PROFILES / "large_gpu.json"))
    assert setup.plan.layout == "duodecoding" and setup.plan.target_gpu_layers == -1
    drafter, notes = build_drafter(setup, target)
    assert drafter is not None and drafter.drafts_ahead and drafter.device.type == "cpu"
    prompt, ref = plain_answer
    target.reset()  # the target stays on this machine's CPU: the drafter is what is tested
    out = generate(target, prompt, drafter, GenerationConfig(48),
                   cost=VerifyCostModel(slope=0.0, learn=False))
    assert out.tokens == ref


@pytest.mark.parametrize("failure", [torch.OutOfMemoryError("CUDA out of memory"),
                                     RuntimeError("CUDA error: device lost")])
@pytest.mark.parametrize("name", ["head-chain", "head-ahead"])
def test_a_drafter_failing_mid_answer_falls_back_to_plain(target, plain_answer, failure, name):
    # head-ahead also fails inside the worker thread that drafts during verification.
    drafter = make_drafter(name, target=target)
    calls = {"n": 0}
    forward = drafter.head.forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 4:  # the GPU goes away after a few steps
            raise failure
        return forward(*args, **kwargs)

    drafter.head.forward = failing_forward
    prompt, ref = plain_answer
    target.reset()
    out = generate(target, prompt, drafter, GenerationConfig(48),
                   cost=VerifyCostModel(slope=0.0, learn=False))
    assert out.tokens == ref  # the conversation goes on, unchanged
    assert "went on with plain decoding" in out.stats.fallback
    assert sum(s.n_proposed for s in out.stats.steps) > 0  # it did draft before failing


def test_auto_gives_a_working_engine_and_explains_itself(target, plain_answer, tmp_path):
    setup = prepare_engine(target, "auto", cache_dir=tmp_path)
    assert setup.planned is not None
    text = setup.planned.plan.describe()
    assert "Layout:" in text and "Why:" in text
    prompt, ref = plain_answer
    target.reset()
    out = generate(target, prompt, setup.drafter, GenerationConfig(48, max_draft=setup.max_draft),
                   governor=setup.governor)
    assert out.tokens == ref
