"""Synthetic GGUFs of real shapes load in llama.cpp and cost what their shape says;
a measured profile round-trips and ``tandem plan --profile`` plans from it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.cli import main
from engine.gguf.header import read_file_facts
from engine.gguf.model_shapes import SHAPES, shape_named
from engine.gguf.synthetic import write_synthetic_gguf
from engine.planning.measured_profile import load_measured_profile, measure_profile
from engine.runtime.target import Target, TargetConfig
from engine.session import check_first_forward
from tests.conftest import PROFILES

MEASURED = sorted(PROFILES.glob("measured_*.json"))


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b"])
def test_a_synthetic_gguf_has_the_shape_and_gives_finite_logits(name, model_path, tmp_path):
    shape = SHAPES[name]
    path = write_synthetic_gguf(shape, tmp_path / f"{name}.gguf", model_path)
    facts = read_file_facts(path)
    assert (facts.architecture, facts.hidden_size, facts.n_layers, facts.n_heads,
            facts.n_kv_heads) == (shape.architecture, shape.hidden_size, shape.n_layers,
                                  shape.n_heads, shape.n_kv_heads)
    # Q4_0 is 4.5 bits a weight: the file is the shape's matrices at that rate (the
    # bundled tokenizer's vocabulary; an untied LM head in Q8_0).
    expected = shape.matrix_params(49152) * 4.5 / 8
    assert 0.95 < path.stat().st_size / expected < 1.1
    with Target(path, TargetConfig(n_ctx=256, n_threads=2)) as target:
        check_first_forward(target)  # finite and not constant
        logits = target.prefill(target.tokenize("A test of the shape.", special=False)).logits
        assert np.isfinite(logits).all() and logits.std() > 0.01


def test_unknown_shapes_are_named():
    with pytest.raises(ValueError, match="known: .*llama-3.1-8b"):
        shape_named("llama-9")


def test_a_small_profile_is_measured_and_round_trips(model_path, tmp_path):
    from engine.runtime.hardware import probe_hardware

    profile = measure_profile(SHAPES["smollm2-135m"], [SHAPES["smollm2-135m"]],
                              tmp_path / "work", model_path, probe_hardware(), 2,
                              contexts=(64, 128), head=True)
    assert set(profile.verify_s) == {64, 128} and all(profile.prefill_s.values())
    assert profile.drafts[0].token_s > 0 and profile.heads["cpu"].width == 576
    # The EAGLE-3 level through llama.cpp, with a public head's 32k draft vocabulary.
    assert profile.eagle3 is not None and profile.eagle3.vocab == 32000
    assert profile.eagle3.level_s > 0 and profile.eagle3.update_s > 0
    assert not list((tmp_path / "work").iterdir())  # the synthetic files are removed
    path = tmp_path / "p.json"
    profile.save(path)
    again = load_measured_profile(path)
    assert again.to_json() == json.loads(json.dumps(profile.to_json()))
    plan = again.plan()
    assert plan.plain_tok_per_s == pytest.approx(1 / profile.verify_s[128][1])
    assert {c.drafter for c in plan.candidates} >= {"memory", "draft"}


def test_a_file_that_is_not_a_profile_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"verify_s": 3}))
    assert main(["plan", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error:") and "is not a measured profile" in err
    assert "\n" not in err
    assert main(["plan", "--profile", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the profile" in capsys.readouterr().err
    for contexts, message in (("1k", "comma-separated token counts"),
                              ("8", "at least 16 tokens")):
        assert main(["profile", "--shape", "smollm2-135m", "--contexts", contexts,
                     "--out", str(tmp_path / "p.json")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.skipif(not MEASURED, reason="no measured profiles recorded")
@pytest.mark.parametrize("path", MEASURED, ids=[p.stem for p in MEASURED])
def test_plan_from_a_measured_profile(path, capsys):
    assert main(["plan", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    profile = load_measured_profile(path)
    assert f"Profile: {profile.target_shape}" in out and "Candidates (predicted):" in out
    assert "Assumed acceptance by depth: 0.65" in out
    # A pair that is right nearly always drafts; one that is never right does not.
    assert main(["plan", "--profile", str(path), "--acceptance", "0.05", "--json"]) == 0
    never = json.loads(capsys.readouterr().out)["plan"]
    assert never["drafter"] == "memory"


def test_the_h100_profile_keeps_drafts_off_the_gpu_it_measured():
    """Measured on an H100 (docs/gpu.md): CUDA's verified batches differed from one-token
    decoding, so the 8B target decodes on the GPU with nothing drafted; were they exact,
    memory drafts would be checked there."""
    from dataclasses import replace

    profile = load_measured_profile(PROFILES / "measured_llama-3.1-8b_h100_16core.json")
    assert profile.gpu_exact is False and profile.gpu_verify_s
    # The GPU's token beats the 16 CPU threads' by far: the target goes there.
    assert profile.gpu_verify_s[256][1] * 5 < profile.verify_s[256][1]
    plan = profile.plan()
    assert plan.target_gpu_layers == -1 and plan.budget.max_draft == 0
    assert "nothing drafted" in plan.layout_text() and "differ" in plan.reason
    assert plan.plain_tok_per_s == pytest.approx(1 / profile.gpu_verify_s[256][1])
    exact = replace(profile, gpu_exact=True).plan()
    assert exact.target_gpu_layers == -1 and exact.budget.max_draft > 0
    assert "drafts from memory" in exact.layout_text()


def test_profile_gpu_is_refused_without_a_gpu_device(tmp_path, capsys):
    from engine.runtime.hardware import probe_hardware

    if probe_hardware().llama_gpu_offload:
        pytest.skip("this machine has a GPU llama.cpp can use")
    assert main(["profile", "--shape", "smollm2-135m", "--gpu",
                 "--out", str(tmp_path / "p.json")]) == 2
    assert "cannot offload to a GPU" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_gpu_profile_round_trips_and_prices_the_gpu(tmp_path):
    from dataclasses import replace

    profile = load_measured_profile(PROFILES / "measured_llama-3.1-8b_h100_16core.json")
    path = tmp_path / "p.json"
    profile.save(path)
    again = load_measured_profile(path)
    assert again == profile
    costs = again.costs()
    assert costs.verify_s["gpu"] == profile.gpu_verify_s[256]
    # A profile from before GPU curves were kept still loads, with none.
    old = json.loads(path.read_text())
    for key in ("gpu_verify_s", "gpu_prefill_s", "gpu_exact"):
        del old[key]
    path.write_text(json.dumps(old))
    assert load_measured_profile(path) == replace(profile, gpu_verify_s={},
                                                  gpu_prefill_s={}, gpu_exact=None)
