"""The EAGLE-3 drafter (engine.drafters.eagle3): an ``eagle3`` GGUF run by llama.cpp beside
the bundled target, fed the target's layer inputs. Greedy output equals plain decoding on
real prompts (long ones prefilled in the F16 context included) with drafts accepted, the
layer export leaves the target's logits bit for bit as they were, and a head that does
not fit is refused before any decode with the reason (issue 35)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.eagle3 import Eagle3Drafter
from engine.errors import IncompatibleDraftError, ModelLoadError
from engine.gguf.eagle3 import Eagle3Shape, shape_for_target, write_eagle3_head
from engine.runtime.native import NativeBatch, NativeContext
from tests.conftest import drafted_equals_plain, pick_per_category, plain_answers

MAX_TOKENS = 24
# Texts whose answers repeat with a period of two tokens (" ", "0", " ", "0", ...): what
# the copying head below guesses right.
REPEATING = ["0 0 0 0 0 0 0 0 0 0 0 0 0 0", "The the the the the the the the the"]


def copying_head(path: Path, target: Path) -> Path:
    """An untrained head whose guess is the token before the last: fc passes layer 0's
    input (the token's embedding) through, attention and FFN add nothing, and the LM head
    (the target's, tied to the embedding) finds that token again. Random weights would
    almost never be accepted."""
    shape = shape_for_target(target, (0, 15, 27))
    e = shape.hidden
    fc = np.zeros((e, 3 * e), np.float32)
    fc[:, :e] = np.eye(e, dtype=np.float32)
    return write_eagle3_head(path, target, shape, {
        "fc.weight": fc,
        "blk.0.attn_output.weight": np.zeros((e, e), np.float32),
        "blk.0.ffn_down.weight": np.zeros((e, shape.ffn), np.float32)})


@pytest.fixture(scope="module")
def head_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copying_head(tmp_path_factory.mktemp("eagle3") / "copying.gguf", model_path)


@pytest.fixture()
def drafter(target, head_path: Path):
    d = Eagle3Drafter(head_path, target)
    yield d
    d.close()
    assert target.ctx.feature_layers == ()  # the target is left as it was


@pytest.fixture(scope="module")
def rows_and_plain(target, dev_prompts):
    # Every other category (7 prompts, the long RAG one among them): the suite's time.
    rows = pick_per_category(dev_prompts, 1)[::2]
    return rows, plain_answers(target, rows, MAX_TOKENS)


def test_greedy_equals_plain_on_real_prompts(target, rows_and_plain, drafter):
    rows, plain = rows_and_plain
    assert any(len(prompt) >= 128 for prompt, _ in plain.values())  # the F16 prefill path
    outs = drafted_equals_plain(target, drafter, rows, plain, MAX_TOKENS)
    # The copying head guesses the token before the last: right on repeating text (the test
    # below asserts acceptance there), on prose mostly wrong, so rejection is exercised.
    steps = [s for out in outs for s in out.stats.steps]
    assert sum(s.n_proposed for s in steps) > sum(s.n_accepted for s in steps)
    assert drafter.stats()["head_levels_per_call"] > 0


def test_drafts_are_accepted_and_output_stays_plain(target, drafter):
    n_accepted = 0
    for text in REPEATING:
        prompt = target.tokenize(text)
        target.reset()
        target.set_features(False)
        plain = generate(target, prompt, None, GenerationConfig(MAX_TOKENS)).tokens
        target.reset()
        # A fixed verification curve: what is verified must not follow the machine's load.
        out = generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS),
                       cost=VerifyCostModel(slope=0.0, learn=False))
        assert out.tokens == plain, text
        assert not out.stats.fallback
        n_accepted += sum(s.n_accepted for s in out.stats.steps)
    assert n_accepted >= 8


def test_the_layer_export_leaves_logits_as_they_were(target):
    """The drafted run reads layer inputs on every decode; plain decoding does not."""
    tokens = target.tokenize("The cat sat on the mat, and the dog sat on the log.")
    n = len(tokens)
    rows = []
    for layers in ((), (0, 15, 27)):
        with NativeContext(target.model, n_ctx=256, n_batch=64, n_seq_max=1, n_threads=2,
                           features=True, feature_layers=layers) as ctx, \
                NativeBatch(64, 1) as batch:
            batch.fill(tokens, list(range(n)), None, True)
            ctx.decode(batch)
            rows.append((ctx.logits(n), ctx.features(n)))
    assert np.array_equal(rows[0][0], rows[1][0])
    features = rows[1][1]
    assert features.shape == (n, 3 * target.n_embd)
    # Layer 0's input is the token's embedding: the same row wherever the token is.
    the = [i for i, t in enumerate(tokens) if t == tokens[4]]
    assert len(the) >= 2 and np.array_equal(features[the[0], :576], features[the[1], :576])


def _refusal(target, path: Path) -> str:
    with pytest.raises((IncompatibleDraftError, ModelLoadError)) as info:
        Eagle3Drafter(path, target)
    assert target.ctx.feature_layers == ()
    return str(info.value)


def test_a_head_that_does_not_fit_is_refused_before_any_decode(target, model_path: Path,
                                                                head_path: Path,
                                                                tmp_path: Path):
    shape = shape_for_target(model_path)
    narrow = Eagle3Shape(hidden=512, n_heads=8, n_kv_heads=2, ffn=1024,
                         target_layers=shape.target_layers, target_hidden=576,
                         context_length=8192, rope_theta=1e5, rms_eps=1e-5)
    why = _refusal(target, write_eagle3_head(tmp_path / "narrow.gguf", model_path, narrow))
    assert "hidden size: the draft has 512, the target 576" in why
    deep = Eagle3Shape(**{**shape.__dict__, "target_layers": (2, 15, 40)})
    why = _refusal(target, write_eagle3_head(tmp_path / "deep.gguf", model_path, deep))
    assert "target layers: the draft has [2, 15, 40]" in why
    why = _refusal(target, write_eagle3_head(tmp_path / "vocab.gguf", model_path,
                                             n_vocab=49152 + 64))
    assert "vocabulary size: the draft has 49216" in why
    truncated = tmp_path / "truncated.gguf"
    data = head_path.read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    assert "cannot load" in _refusal(target, truncated)
    assert "architecture: the draft has llama" in _refusal(target, model_path)  # not a head at all


def test_the_bundled_trained_head_drafts_losslessly_and_is_accepted(target, rows_and_plain):
    """The head trained here (assets/eagle3-smollm2-135m), by name as users run it."""
    from engine.drafters import DEFAULT_EAGLE3_HEAD, make_drafter

    assert DEFAULT_EAGLE3_HEAD.is_file()
    rows, plain = rows_and_plain
    drafter = make_drafter("eagle3", target=target)
    try:
        outs = drafted_equals_plain(target, drafter, rows, plain, MAX_TOKENS)
    finally:
        drafter.close()
    steps = [s for out in outs for s in out.stats.steps]
    accepted = sum(s.n_accepted for s in steps)
    assert accepted >= 0.1 * len(rows) * MAX_TOKENS, accepted  # a trained head, not luck
    assert sum(s.n_proposed for s in steps) > accepted  # every node verified: some wrong


@pytest.mark.slow
def test_sampling_with_the_head_keeps_the_target_distribution(fresh_target):
    from engine.drafters import make_drafter
    from tests.conftest import second_token_counts
    from tests.stats_helpers import two_sample_z

    t = fresh_target
    prompt = t.chat_prompt([{"role": "user", "content": "Name a colour and say why you like it."}])
    drafter = make_drafter("eagle3", target=t)
    n_runs = 120
    try:
        plain, spec, n_proposed = second_token_counts(t, prompt, drafter, n_runs)
    finally:
        drafter.close()
    assert n_proposed > n_runs  # the head really drafted
    assert plain.sum() > 0.9 * n_runs and spec.sum() > 0.9 * n_runs
    assert two_sample_z(plain, spec) < 4.0


def test_auto_measures_and_prices_the_bundled_eagle3_head(model_path: Path, tmp_path: Path):
    """The planner measures the bundled EAGLE-3 head's level and update on this machine,
    weighs it with the acceptance it ships (its training report), and a plan forced to it
    drafts with it, losslessly; its answers then feed the pair's record (issue 35,
    item 3)."""
    from engine.drafters.eagle3 import Eagle3Drafter
    from engine.planning.draft_record import DraftRecord, pair_key
    from engine.planning.planner import Overrides
    from engine.session import Engine, EngineConfig

    config = EngineConfig(model_path=model_path, n_ctx=1024, n_threads=2, cache_dir=tmp_path,
                          memory_dir=tmp_path / "memory")
    with Engine(config) as engine:
        costs = engine.costs
        assert costs is not None and costs.eagle3_level_s["cpu"] > 0
        assert costs.eagle3_update_s["cpu"] > 0
        priced = [c for c in engine.plan.candidates if c.drafter == "eagle3"]
        assert priced and priced[0].budget.depth >= 1
    forced = replace(config, overrides=Overrides(layout="cpu", drafter="eagle3"))
    with Engine(forced) as engine:
        assert engine.plan.drafter == "eagle3" and isinstance(engine.drafter, Eagle3Drafter)
        assert "EAGLE-3" in engine.plan.layout_text()
        head = engine.drafter.path
        # a fixed verification curve: one learnt under load can decline every draft
        engine.cost = VerifyCostModel(slope=0.35, learn=False)
        prompt = engine.target.tokenize(REPEATING[0])
        out = engine.generate(prompt, GenerationConfig(MAX_TOKENS))
        assert out.tokens == engine.generate(prompt, GenerationConfig(MAX_TOKENS),
                                             plain=True).tokens
        assert sum(s.n_accepted for s in out.stats.steps) > 0  # the head's drafts were taken
    _, source = DraftRecord(tmp_path).acceptance(pair_key(model_path, head), (0.5,))
    assert source.startswith("measured over")


def test_the_planner_picks_an_eagle3_head_that_pays():
    """On costs where a level is cheap and verification nearly free per token, a head
    that is often right wins, and the plan says which head and on what acceptance."""
    from engine.planning.calibration import CostProfile
    from engine.planning.planner import Eagle3Facts, choose_plan
    from engine.runtime.hardware import HardwareProfile
    from engine.runtime.model_info import ModelFacts

    costs = CostProfile(verify_s={"cpu": {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.014, 16: 0.02}},
                        eagle3_level_s={"cpu": 0.0005}, eagle3_update_s={"cpu": 0.001})
    hw = HardwareProfile(physical_cores=2, logical_cores=2, cpu_model="cpu", cpu_features=(),
                         ram_total_bytes=8 << 30, ram_available_bytes=6 << 30, gpus=())
    facts = ModelFacts(size_bytes=100 << 20, n_layers=30, kv_bytes=10 << 20)
    plan = choose_plan(hw, costs, facts, None, eagle3=Eagle3Facts("head.gguf", (0.8,) * 8,
                                                                  "measured"))
    assert plan.drafter == "eagle3" and plan.predicted_speedup > 2
    assert "the EAGLE-3 head head.gguf" in plan.reason and "measured" in plan.reason
    weak = choose_plan(hw, costs, facts, None, eagle3=Eagle3Facts("head.gguf", (0.05,) * 8))
    assert weak.drafter == "memory" and "EAGLE-3" in weak.reason
