"""llama.cpp's prompt kernels as a switch (packaging/llama-cpp/prompt-kernels.patch):
llamafile's sgemm and the tiled K-quant matmul on for a prompt's prefill only, off for
every verification and one-token decode, and never on for another thread's decode."""

from __future__ import annotations

import platform
import threading
import time

import numpy as np
import pytest

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.drafters.lookup import PromptLookupDrafter
from engine.runtime.f16_prefill import F16_PREFILL_MIN_TOKENS
from engine.runtime.native import kernel_settings, prompt_kernels, prompt_kernels_available
from engine.runtime.prompt_weights import prompts_prefer_repacked
from engine.runtime.target import Target, TargetConfig


@pytest.fixture(scope="module")
def direct_target(f32_model_path):
    """The F32 weights (sgemm sums their batches in another order) with every prompt
    prefilled here, with the kernels the test sets."""
    config = TargetConfig(n_ctx=1024, n_threads=2, f16_prefill=False, prompt_kernels=False)
    with Target(f32_model_path, config) as target:
        yield target


@pytest.fixture(scope="module")
def prompt(direct_target, dev_prompts) -> list[int]:
    """~300 tokens: sgemm's tiles take batches this size (31 tokens summed alike)."""
    text = next(r for r in dev_prompts if r["category"] == "summarization")["turns"][0]
    return direct_target.tokenize(text)[:300]


def _prefill_logits(target: Target, prompt: list[int]) -> np.ndarray:
    target.reset()
    return target.prefill(prompt).logits.copy()


def test_the_build_has_the_switch():
    """`make install` patches llama.cpp and builds sgemm in: a lost step fails here."""
    assert prompt_kernels_available()
    settings = kernel_settings(True)
    assert settings["llamafile_sgemm"] == settings["tiled_matmul"] == "prompts"


def test_sgemm_changes_a_batch_inside_the_switch_only(direct_target, prompt):
    off = _prefill_logits(direct_target, prompt)
    with prompt_kernels() as on:
        assert on
        inside = _prefill_logits(direct_target, prompt)
    after = _prefill_logits(direct_target, prompt)
    assert not np.array_equal(inside, off)  # F32 weights: sgemm sums the batch otherwise
    assert np.abs(inside - off).max() < 1.0
    assert np.array_equal(after, off)  # and it is off again


def test_a_nested_block_leaves_the_switch_on_until_the_outer_one_ends(direct_target, prompt):
    with prompt_kernels():
        inside = _prefill_logits(direct_target, prompt)
        with prompt_kernels():
            pass
        still = _prefill_logits(direct_target, prompt)  # the inner block ended: still on
    assert np.array_equal(still, inside)
    assert not np.array_equal(_prefill_logits(direct_target, prompt), inside)  # off now


def test_another_threads_decode_waits_for_the_switch(direct_target, prompt):
    off = _prefill_logits(direct_target, prompt)
    entered = threading.Event()

    def hold() -> None:
        with prompt_kernels():
            entered.set()
            time.sleep(1.0)  # a prefill of these tokens takes ~0.5 s

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait()
    try:
        waited = _prefill_logits(direct_target, prompt)
    finally:
        holder.join()
    assert np.array_equal(waited, off)


def test_long_prompts_prefill_with_sgemm_and_answers_equal_plain(f32_model_path, dev_prompts):
    """The F16 context prefills with sgemm (its logits move), and the drafted answer
    equals plain decoding's, both after that prefill."""
    row = next(r for r in dev_prompts if r["category"] == "summarization")
    logits = {}
    for sgemm in (False, True):
        # With flash attention: the F16 context reads the prompt (without it, this cache).
        config = TargetConfig(n_ctx=2048, n_threads=2, prompt_kernels=sgemm, flash_attn=True)
        with Target(f32_model_path, config) as target:
            prompt = target.chat_prompt([{"role": "user", "content": row["turns"][0]}])
            assert len(prompt) >= F16_PREFILL_MIN_TOKENS
            logits[sgemm] = _prefill_logits(target, prompt)
            assert not target.f16_prefill_off
            if not sgemm:
                continue
            gen = GenerationConfig(max_tokens=48)
            target.reset()
            plain = generate(target, prompt, None, gen)
            target.reset()
            # A fixed verification curve: what is drafted must not follow the machine's load.
            drafted = generate(target, prompt, PromptLookupDrafter(), gen,
                               cost=VerifyCostModel(slope=0.0, learn=False))
            assert drafted.tokens == plain.tokens
            assert drafted.stats.mean_accepted > 1  # drafts were taken
            steps = drafted.stats.steps  # and some taken back
            assert sum(s.n_proposed - s.n_accepted for s in steps) > 0
    assert not np.array_equal(logits[True], logits[False])


def test_prompts_prefilled_here_take_the_prompt_kernels_and_answer_alike_again(
        f32_model_path, direct_target, prompt):
    """A prompt prefilled in this cache (F16 prefill off, or too short for it) goes
    through the prompt kernels; asked again with its answer cached (a regenerate), it
    gets the same first-token logits, not a one-token decode's, and the same answer."""
    with prompt_kernels():
        expected = _prefill_logits(direct_target, prompt)
    config = TargetConfig(n_ctx=1024, n_threads=2, f16_prefill=False)
    with Target(f32_model_path, config) as target:
        target.reset()
        first = generate(target, prompt, None, GenerationConfig(max_tokens=12))
        assert np.array_equal(target.prefill(prompt).logits, expected)
        again = generate(target, prompt, None, GenerationConfig(max_tokens=12))
    assert again.stats.n_prompt_reused == len(prompt)
    assert again.tokens == first.tokens


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the tiled matmul is x86's")
def test_the_prompt_layout_follows_the_files_weight_types(model_path, f32_model_path,
                                                          quantized):
    """Q4_0 prompts are fastest repacked; a K-quant's through the tiled matmul, on plain
    weights; floats do not care. A repacked Q4_K_M target gets a plain copy for its
    prompts, an unrepacked Q4_0 one a repacked copy, a float one none."""
    assert prompts_prefer_repacked(model_path) is True
    assert prompts_prefer_repacked(quantized("q4_k_m")) is False
    assert prompts_prefer_repacked(f32_model_path) is None
    for path, repack, copy_repacked in ((quantized("q4_k_m"), True, False),
                                        (model_path, False, True),
                                        (f32_model_path, True, None)):
        with Target(path, TargetConfig(n_ctx=512, n_threads=2, repack=repack)) as t:
            copy = t.prompts.f16.prefill_model
            assert (copy.repack if copy is not None else None) == copy_repacked
