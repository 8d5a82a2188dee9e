"""Shared fixtures: the real bundled model, prepared once per test session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from training.spec_bench import DEV_PROMPTS

# Qt offscreen unless a display is asked for: a test file run alone creates its
# QApplication (pytest-qt) before any GUI helper is imported.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

REPO = Path(__file__).resolve().parents[1]
# Recorded machines and cost curves; the ones named synthetic_* are invented, not measured.
PROFILES = Path(__file__).resolve().parent / "profiles"


@pytest.fixture(scope="session")
def tandem_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Reuse the developer's prepared model when TANDEM_HOME is set; else a private one.
    home = Path(os.environ.get("TANDEM_HOME") or tmp_path_factory.mktemp("tandem-home"))
    os.environ["TANDEM_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def model_path(tandem_home: Path) -> Path:
    from engine.hub.model_store import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def target(model_path: Path):
    from engine.runtime.target import Target, TargetConfig

    with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2)) as t:
        yield t


@pytest.fixture()
def fresh_target(target):
    target.reset()
    target.set_features(False)
    return target


@pytest.fixture(scope="session")
def dev_prompts() -> list[dict]:
    if not DEV_PROMPTS.is_file():
        pytest.fail(f"benchmark prompts not found at {DEV_PROMPTS}")
    return [json.loads(line) for line in DEV_PROMPTS.read_text().splitlines() if line.strip()]


def pick_per_category(dev_prompts: list[dict], per_category: int) -> list[dict]:
    """The first ``per_category`` prompts of each category, in file order."""
    seen: dict[str, int] = {}
    out = []
    for row in dev_prompts:
        if seen.get(row["category"], 0) < per_category:
            seen[row["category"]] = seen.get(row["category"], 0) + 1
            out.append(row)
    return out


def plain_answers(target, rows: list[dict], max_tokens: int) -> dict:  # noqa: ANN001
    """question id -> (first-turn prompt tokens, plain greedy answer tokens)."""
    from engine.decoding.generation import GenerationConfig, generate

    plain = {}
    for row in rows:
        target.reset()
        target.set_features(False)
        prompt = target.chat_prompt([{"role": "user", "content": row["turns"][0]}])
        plain[row["question_id"]] = (prompt, generate(target, prompt, None,
                                                      GenerationConfig(max_tokens)).tokens)
    return plain


def drafted_equals_plain(target, drafter, rows: list[dict], plain: dict,  # noqa: ANN001
                         max_tokens: int, *, free_verification: bool = True,
                         after=None) -> list:  # noqa: ANN001
    """Generate each row's first turn with ``drafter`` and assert the tokens equal
    ``plain``'s; the results, for their figures. With ``free_verification`` every drafted
    node is verified (the tree paths, not only what the budget keeps); else the budget
    trims as in use, by a fixed verification curve (a batch of n costs 1 + 0.35 (n - 1)
    tokens) instead of one learnt from this machine's decodes, so what is verified does not
    follow the machine's load. A drafter that failed mid-answer fails the check.
    ``after(prompt, result)`` runs after each row."""
    from engine.decoding.budget import VerifyCostModel
    from engine.decoding.generation import GenerationConfig, generate

    outs = []
    for row in rows:
        prompt, ref = plain[row["question_id"]]
        target.reset()
        cost = VerifyCostModel(slope=0.0 if free_verification else 0.35, learn=False)
        out = generate(target, prompt, drafter, GenerationConfig(max_tokens), cost=cost)
        assert out.tokens == ref, f"question {row['question_id']} ({row['category']})"
        # Equal tokens prove nothing about drafting once the drafter crashed mid-answer
        # (the rest went on plainly, as a user's answer must).
        assert not out.stats.drafter_failed_in, (
            f"question {row['question_id']}: {out.stats.fallback}")
        if after is not None:
            after(prompt, out)
        outs.append(out)
    return outs


def second_token_counts(target, prompt: list[int], drafter, n_runs: int,  # noqa: ANN001
                        ) -> tuple[np.ndarray, np.ndarray, int]:
    """How often each token comes second in a 3-token sampled answer (temperature 1,
    top-k 50), plain and with ``drafter`` (other seeds, verification priced free so
    every drafted node is judged), and how many draft tokens were proposed."""
    from engine.decoding.budget import VerifyCostModel
    from engine.decoding.generation import GenerationConfig, generate
    from engine.decoding.sampling import SamplingParams

    plain = np.zeros(target.n_vocab)
    spec = np.zeros(target.n_vocab)
    n_proposed = 0
    target.reset()
    for seed in range(n_runs):
        for counts, run_seed, run_drafter in ((plain, seed, None),
                                              (spec, 10_000 + seed, drafter)):
            cfg = GenerationConfig(max_tokens=3, sampling=SamplingParams(
                seed=run_seed, temperature=1.0, top_k=50))
            # No reset: every run after the first finds the prompt cached but its last
            # token (the prefill rolls the last answer back), plain and drafted alike.
            out = generate(target, prompt, run_drafter, cfg,
                           cost=VerifyCostModel(slope=0.0, learn=False))
            if run_drafter is not None:
                n_proposed += sum(s.n_proposed for s in out.stats.steps)
            if len(out.tokens) > 1:
                counts[out.tokens[1]] += 1
    return plain, spec, n_proposed


def second_turn(target, row: dict, first: list[int], max_tokens: int
                ) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """The second turn's prompt after the model's ``first`` answer, and its plain greedy
    answer with the first turn in the cache, as in a chat. (From a cold cache it may
    differ at a near-tie: a long prompt's cells come from the F16 prefill context,
    while a warm cache holds the first answer as decoding wrote it.)"""
    from engine.decoding.generation import GenerationConfig, generate

    messages = [{"role": "user", "content": row["turns"][0]},
                {"role": "assistant", "content": target.detokenize(first)},
                {"role": "user", "content": row["turns"][1]}]
    prompt = target.chat_prompt(messages)
    target.reset()
    generate(target, target.chat_prompt(messages[:1]), None, GenerationConfig(max_tokens))
    return prompt, generate(target, prompt, None, GenerationConfig(max_tokens)).tokens


@pytest.fixture(scope="session")
def f32_model_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model's weights in F32: the same vocabulary and answers' model, but
    memory-bound like a 7B on a laptop (where verifying a batch is cheap), and a real
    target for the bundled Q4_0 as its draft model."""
    from engine.hub.convert import convert

    path = tmp_path_factory.mktemp("f32") / "SmolLM2-135M-Instruct.F32.gguf"
    return convert(model_path, path, "f32", 2)


@pytest.fixture(scope="session")
def quantized(f32_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """name -> the bundled weights requantized to that type (made on first use)."""
    from engine.hub.convert import quantize_as

    folder = tmp_path_factory.mktemp("quants")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            path = folder / f"SmolLM2-135M-Instruct.{name.upper()}.gguf"
            made[name] = quantize_as(f32_model_path, path, name, 2)
        return made[name]

    return get


@pytest.fixture(scope="session")
def f32_target(f32_model_path: Path):
    from engine.runtime.target import Target, TargetConfig

    with Target(f32_model_path, TargetConfig(n_ctx=2048, n_threads=2)) as t:
        yield t


def follow_up_with_features(target, base: list[int], prompt: list[int], tail: int = 32,  # noqa: ANN001
                            again: bool = False) -> tuple[np.ndarray, list]:
    """``prompt`` (``base`` then a follow-up) read after ``base``: plain decoding's
    first-token logits, then the prefills a feature drafter's session makes (features
    on, ``tail`` asked; with ``again``, the same prompt a second time: a regenerate)."""
    target.reset(cold=True)
    target.prefill(base)
    plain = target.prefill(prompt).logits.copy()
    target.reset(cold=True)
    target.set_features(True)
    try:
        target.prefill(base, feature_tail=tail)
        drafted = [target.prefill(prompt, feature_tail=tail)]
        drafted[0].logits = drafted[0].logits.copy()
        if again:
            drafted.append(target.prefill(prompt, feature_tail=tail))
    finally:
        target.set_features(False)
    return plain, drafted
