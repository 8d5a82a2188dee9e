"""The Engine on the real model: built once in order (probe, header, calibration and its
cache, plan, target, drafter), fallbacks when the GPU is missing or fails mid-generation
(the answer is still exactly the target's), and a clear error after close."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters import DEFAULT_HEAD_DIR, make_drafter
from engine.errors import ClosedError
from engine.planning.calibration import CalibrationCache, CostProfile, cache_key
from engine.planning.planner import LAYOUTS, Overrides
from engine.runtime.hardware import load_profile, probe_hardware
from engine.session import Engine, EngineConfig
from tests.conftest import PROFILES

PROMPT = [{"role": "user", "content": "List three uses of a paperclip, one line each."}]


@pytest.fixture(scope="module")
def plain_answer(target):
    target.reset()
    target.set_features(False)
    prompt = target.chat_prompt(PROMPT)
    return prompt, generate(target, prompt, None, GenerationConfig(48)).tokens


def _engine(model_path, tmp_path, **options) -> Engine:
    hardware = options.pop("hardware", None)
    config = EngineConfig(model_path=model_path, n_ctx=2048, n_threads=2, cache_dir=tmp_path,
                          **options)
    return Engine(config, hardware=hardware)


def test_calibration_is_measured_once_then_cached(model_path, tmp_path, monkeypatch):
    import engine.planning.plan_maker as session
    from engine.planning.machine_load import LoadReading

    # Costs measured while busy are measured again at a quiet start: the machine looks
    # busy here, so a provisional first measurement is kept like any other.
    monkeypatch.setattr(session, "look_at_load", lambda _t: LoadReading(2.0, 0.3, 0))
    with _engine(model_path, tmp_path) as first:
        assert first.calibrated_now
        curve = first.costs.verify_s["cpu"]
        assert set(curve) >= {1, 2, 4, 8} and all(t > 0 for t in curve.values())
        times = [curve[n] for n in sorted(curve)]
        assert times == sorted(times)  # a bigger batch never costs less
        assert first.costs.head_level_s["cpu"] > 0  # the bundled head was measured
    with _engine(model_path, tmp_path) as again:
        assert not again.calibrated_now and again.costs == first.costs
        assert again.plan.layout in LAYOUTS and again.plan.reason
    with _engine(model_path, tmp_path, recalibrate=True) as fresh:
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
    # Where the target and head were measured is part of the key.
    assert cache_key(hw, model, head, 2, ("cpu", "gpu")) != cache_key(hw, model, head, 2)
    assert cache_key(hw, model, head, 2, head_devices=("cpu", "cuda:0")) != cache_key(
        hw, model, head, 2, head_devices=("cpu",))
    cache = CalibrationCache(tmp_path)
    profile = CostProfile(verify_s={"cpu": {1: 0.01, 2: 0.015}})
    cache.put(changed, profile)
    assert cache.get(changed) == profile and cache.get(key) is None


def test_a_missing_gpu_moves_the_head_to_the_cpu(model_path, plain_answer, tmp_path):
    # A recorded laptop with a CUDA GPU, on this machine where torch has none.
    with _engine(model_path, tmp_path, overrides=Overrides(layout="dovetail"),
                 hardware=load_profile(PROFILES / "synthetic_gpu_no_offload.json")) as engine:
        assert engine.plan.head_device == "cuda:0"
        # auto plans the head with the memory drafter beside it (head+memory).
        assert engine.drafter is not None and engine.drafter.name == "head+memory"
        assert engine.drafter.head.device.type == "cpu"
        assert any("could not run on cuda:0" in n for n in engine.notes)
        engine.cost = VerifyCostModel(slope=0.0, learn=False)  # verify every drafted node
        engine.governor = None
        prompt, ref = plain_answer
        out = engine.generate(prompt, GenerationConfig(48))
        assert out.tokens == ref
        accepted = sum(s.n_accepted for s in out.stats.steps)
        assert 0 < accepted < sum(s.n_proposed for s in out.stats.steps)  # the CPU head drafted


def test_a_duodecoding_plan_drafts_ahead_on_the_cpu(model_path, plain_answer, tmp_path):
    with _engine(model_path, tmp_path, overrides=Overrides(layout="duodecoding"),
                 hardware=load_profile(PROFILES / "synthetic_large_gpu.json")) as engine:
        assert engine.plan.layout == "duodecoding" and engine.plan.target_gpu_layers == -1
        assert "gpu" in engine.costs.verify_s  # the target was measured where it would run
        drafter = engine.drafter
        assert drafter is not None and drafter.drafts_ahead and drafter.device.type == "cpu"
        engine.cost = VerifyCostModel(slope=0.0, learn=False)  # verify every drafted node
        engine.governor = None
        prompt, ref = plain_answer
        out = engine.generate(prompt, GenerationConfig(48))
        assert out.tokens == ref
        accepted = sum(s.n_accepted for s in out.stats.steps)
        assert 0 < accepted < sum(s.n_proposed for s in out.stats.steps)


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
        if calls["n"] > 12:  # the GPU goes away after a few steps (up to 5 calls each)
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


def test_auto_gives_a_working_engine_and_explains_itself(model_path, plain_answer, tmp_path):
    with _engine(model_path, tmp_path) as engine:
        text = engine.plan.describe()
        assert "Layout:" in text and "Why:" in text
        # The drafter follows from the plan, whichever this machine's costs gave.
        assert engine.drafter_name == engine.plan.runs
        prompt, ref = plain_answer
        assert engine.generate(prompt, GenerationConfig(48)).tokens == ref
        assert engine.generate(prompt, GenerationConfig(48), plain=True).tokens == ref


def test_a_head_that_does_not_fit_falls_back_with_a_note(model_path, tmp_path):
    bad = tmp_path / "head"
    shutil.copytree(DEFAULT_HEAD_DIR, bad)
    (bad / "head.safetensors").write_bytes(b"not safetensors at all")
    with _engine(model_path, tmp_path, drafter="head", head_dir=bad) as engine:
        assert engine.drafter_name == "memory"
        assert any(str(bad) in n and "weights" in n for n in engine.notes), engine.notes
        assert "using drafts from memory instead" in engine.notes


def test_a_closed_engine_raises_a_clear_error(model_path, tmp_path):
    engine = _engine(model_path, tmp_path, drafter="none")
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(ClosedError, match="has been closed"):
        engine.generate(prompt, GenerationConfig(4))
    with pytest.raises(ClosedError):
        engine.target.tokenize("hello")
    with pytest.raises(ClosedError):
        engine.target.ctx.kv_clear()


def test_memory_is_kept_per_model_and_a_corrupt_file_is_rebuilt(model_path, tmp_path):
    memory_dir = tmp_path / "memory"
    prompt_msgs = [{"role": "user", "content": "Name three colours."}]
    with _engine(model_path, tmp_path, drafter="memory", memory_dir=memory_dir) as engine:
        assert engine.drafter_name == "memory" and not engine.notes
        engine.generate(engine.chat_prompt(prompt_msgs), GenerationConfig(24))
        saved = list(memory_dir.iterdir())
        assert len(saved) == 1 and saved[0].stat().st_size > 0
    with _engine(model_path, tmp_path, drafter="memory", memory_dir=memory_dir) as engine:
        assert engine.memory.n_sequences == 1  # what the model wrote last time is back
    saved[0].write_bytes(saved[0].read_bytes()[:40] + b"\xff" * 8)  # damaged on disk
    with _engine(model_path, tmp_path, drafter="memory", memory_dir=memory_dir) as engine:
        assert any(str(saved[0]) in n for n in engine.notes), engine.notes
        assert engine.memory.n_sequences == 0
        out = engine.generate(engine.chat_prompt(prompt_msgs), GenerationConfig(24))
        assert out.tokens  # still answers; the next save replaces the damaged file
    with _engine(model_path, tmp_path, drafter="memory", memory_dir=memory_dir) as engine:
        assert not engine.notes and engine.memory.n_sequences == 1


def test_the_head_with_memory_keeps_the_models_memory(model_path, tmp_path):
    """head+memory drafts from the session's memory of this model and saves into it."""
    memory_dir = tmp_path / "memory"
    prompt = [{"role": "user", "content": "Name three colours."}]
    for remembered in (0, 1):
        with _engine(model_path, tmp_path, drafter="head+memory",
                     memory_dir=memory_dir) as engine:
            assert engine.drafter_name == "head+memory" and not engine.notes
            assert engine.memory.n_sequences == remembered
            engine.generate(engine.chat_prompt(prompt), GenerationConfig(24))
            assert engine.memory.n_sequences == remembered + 1


def test_the_kv_cache_setting_and_its_trade_off(model_path, tmp_path):
    with _engine(model_path, tmp_path, drafter="none") as exact:
        assert exact.target.config.type_k == "q8_0"
        assert "identical to plain decoding" in exact.kv_cache_text
    with _engine(model_path, tmp_path, drafter="none", kv_cache="fast") as fast:
        assert (fast.target.config.type_k, fast.target.config.type_v) == ("f16", "f16")
        assert "may differ from plain decoding" in fast.kv_cache_text
        prompt = fast.chat_prompt([{"role": "user", "content": "Hi"}])
        assert fast.generate(prompt, GenerationConfig(4)).tokens
    with pytest.raises(ValueError, match="kv_cache must be one of exact, fast, got 'quick'"):
        EngineConfig(kv_cache="quick")


def test_a_model_with_zeroed_weights_is_refused_at_load(model_path, tmp_path):
    """The bundled model with its tensor data zeroed loads in llama.cpp and would answer
    garbage; its first forward pass gives every token one score, and the engine says so."""
    import gguf

    from engine.errors import ModelLoadError

    zeroed = tmp_path / "zeroed.gguf"
    shutil.copy(model_path, zeroed)
    start = gguf.GGUFReader(str(model_path)).data_offset
    with zeroed.open("r+b") as fh:
        fh.seek(start)
        fh.write(bytes(zeroed.stat().st_size - start))
    with pytest.raises(ModelLoadError, match="zeroed"):
        Engine(EngineConfig(model_path=zeroed, drafter="none", n_threads=2, n_ctx=256))
    with Engine(EngineConfig(model_path=model_path, drafter="none", n_threads=2,
                             n_ctx=256)) as engine:  # and a good model still opens
        assert engine.generate(engine.chat_prompt([{"role": "user", "content": "Hi"}]),
                               GenerationConfig(max_tokens=2)).tokens
