"""The MTP drafter (engine.drafters.mtp): the target GGUF's own next-token block, run by
llama.cpp in a second context over the same model, on a synthetic Qwen3.5 (gated delta
nets beside attention, so rollback is through state snapshots) and a synthetic GLM-4.5
(attention and experts). Greedy output equals
plain decoding with drafts accepted and rejected, the block's cache is rolled back with
the target's, and a model that cannot draft this way is refused before any decode with
the reason, falling back to memory drafts (issue 35, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters import DrafterSpec, open_drafter
from engine.drafters.mtp import MtpDrafter
from engine.errors import DrafterUnavailableError, ModelLoadError
from engine.gguf.architectures import MTP_LAYOUTS, TinyShape, write_architecture_gguf
from engine.runtime.architecture import RS_ROLLBACK_TOKENS
from engine.runtime.native import NativeContext
from engine.runtime.target import Target, TargetConfig

MAX_TOKENS = 32
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown",
           "def add(a, b):\n    return a + b\n\nprint(add(",
           "Once upon a time, in a small village by the sea, there lived"]
# Layers that add little to the residual stream: the model often says its last token
# again, which this block (eh_proj passes the token's embedding) guesses; the rest of the
# time it does not, so drafts are both accepted and rejected.
MTP_SHAPE = TinyShape(mtp_layers=1, damp=0.22)


@pytest.fixture(scope="module", params=MTP_LAYOUTS)
def mtp_model(request: pytest.FixtureRequest, model_path: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5's block (a hybrid target: rollback through state snapshots) and GLM-4.5's
    (attention with biases and experts, a dense first layer)."""
    arch = request.param
    return write_architecture_gguf(arch, tmp_path_factory.mktemp("mtp") / f"{arch}-mtp.gguf",
                                   model_path, MTP_SHAPE)


@pytest.fixture(scope="module")
def mtp_target(mtp_model: Path):
    with Target(mtp_model, TargetConfig(n_ctx=512, n_threads=2)) as target:
        yield target


def _generate(target: Target, prompt: list[int], drafter) -> object:  # noqa: ANN001
    target.reset()
    if drafter is None:
        target.set_features(False)
    return generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS),
                    cost=VerifyCostModel(slope=0.0, learn=False))


def test_greedy_equals_plain_with_drafts_accepted_and_rejected(mtp_target):
    target = mtp_target
    assert target.model.mtp_loaded
    assert target.arch.rs_rollback or not target.arch.has_state
    drafter = MtpDrafter(target)
    accept, ends = drafter.accept, []

    def accept_and_check(new_tokens, features):  # noqa: ANN001, ANN202
        accept(new_tokens, features)
        # The block's cache ends at the newest token, which the target has yet to
        # evaluate: the rejected tokens' entries and the draft's own are gone.
        ends.append((drafter.ctx.kv_pos_max(0), target.n_past))

    drafter.accept = accept_and_check  # type: ignore[method-assign]
    try:
        accepted = rejected = 0
        for text in PROMPTS:
            prompt = target.tokenize(text)
            plain = _generate(target, prompt, None).tokens
            out = _generate(target, prompt, drafter)
            assert out.tokens == plain, text
            assert not out.stats.fallback
            steps = out.stats.steps
            accepted += sum(s.n_accepted for s in steps)
            rejected += sum(s.n_proposed - s.n_accepted for s in steps)
        assert accepted >= 10 and rejected >= 5
        assert ends and all(mine == theirs for mine, theirs in ends)
        assert drafter.stats()["head_levels_per_call"] > 0
    finally:
        drafter.close()
    assert not target.ctx.next_features  # the target is left as it was


def test_a_second_answer_reuses_the_prompt_and_stays_plain(mtp_target):
    """The prompt's cached prefix is kept by the target; the block starts over."""
    target = mtp_target
    prompt = target.tokenize(PROMPTS[0])
    plain = _generate(target, prompt, None).tokens
    with_turn = prompt + plain[:5] + target.tokenize(" and then", special=False)
    plain_2 = _generate(target, with_turn, None).tokens
    drafter = MtpDrafter(target)
    try:
        target.reset()
        cost = VerifyCostModel(slope=0.0, learn=False)
        assert generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS),
                        cost=cost).tokens == plain
        out = generate(target, with_turn, drafter, GenerationConfig(MAX_TOKENS), cost=cost)
        assert out.tokens == plain_2
        assert sum(s.n_accepted for s in out.stats.steps) > 0  # the block drafts after reuse
    finally:
        drafter.close()


def test_a_model_without_mtp_layers_is_refused_and_falls_back(target):
    """The bundled llama model has no next-token block."""
    with pytest.raises(DrafterUnavailableError, match="no next-token"):
        MtpDrafter(target)
    assert not target.ctx.next_features
    drafter, notes = open_drafter(DrafterSpec("mtp"), target)
    assert drafter is not None and drafter.name == "memory"
    assert "MTP block could not run" in notes[0] and "memory" in notes[0]


def test_mtp_layers_not_loaded_are_refused_not_aborted(mtp_model: Path):
    """llama.cpp makes an MTP context over weights it skipped, then aborts on decode."""
    with Target(mtp_model, TargetConfig(n_ctx=256, n_threads=2, load_mtp=False)) as target:
        with pytest.raises(DrafterUnavailableError, match="loaded without"):
            MtpDrafter(target)
        with pytest.raises(ModelLoadError, match="not loaded"):
            NativeContext(target.model, n_ctx=256, n_batch=64, n_seq_max=1, n_threads=2,
                          features=False, mtp=True)


def test_auto_measures_and_prices_the_mtp_block(mtp_model: Path, tmp_path: Path):
    """The engine's planner measures the block's level and update on this machine and
    weighs it beside plain decoding; forcing it through the overrides runs it."""
    from engine.planning.planner import Overrides
    from engine.session import Engine, EngineConfig

    config = EngineConfig(model_path=mtp_model, n_ctx=512, n_threads=2, cache_dir=tmp_path)
    with Engine(config) as engine:
        costs = engine.costs
        assert costs is not None and costs.mtp_level_s["cpu"] > 0
        assert costs.mtp_update_s["cpu"] > 0
        assert any(c.drafter == "mtp" for c in engine.plan.candidates)
        if engine.target.arch.has_state:  # batches past the snapshots are never measured
            assert max(costs.verify_s["cpu"]) <= RS_ROLLBACK_TOKENS + 1
    forced = EngineConfig(model_path=mtp_model, n_ctx=512, n_threads=2, cache_dir=tmp_path,
                          overrides=Overrides(layout="cpu", drafter="mtp"))
    with Engine(forced) as engine:
        assert engine.plan.drafter == "mtp" and engine.drafter_name == "mtp"
        prompt = engine.target.tokenize(PROMPTS[0])
        out = engine.generate(prompt, GenerationConfig(MAX_TOKENS))
        assert out.tokens == engine.generate(prompt, GenerationConfig(MAX_TOKENS),
                                             plain=True).tokens
