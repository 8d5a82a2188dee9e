"""An independent reference for "what the target alone would produce": Tandem's plain
decoding equals llama.cpp decoding one token at a time through llama-cpp-python's own
``Llama`` (not Tandem's wrapper), token for token, with the same cache types, batch size
and kernels. Tandem's F16 prefill context and prompt kernels are off here: they are
Tandem's own way of reading a prompt (docs/engine.md, "Losslessness"), shared by its plain
and drafted answers but not by llama-cpp-python."""

from __future__ import annotations

import llama_cpp
import pytest

from engine.decoding.generation import GenerationConfig, generate
from engine.runtime.target import Target, TargetConfig
from tests.conftest import pick_per_category

MAX_TOKENS = 32
N_BATCH = 256
CONFIG = TargetConfig(n_ctx=2048, n_threads=2, n_batch=N_BATCH, f16_prefill=False,
                      prompt_kernels=False, prefill_copy=False)


def _llama_cpp_python(path, flash_attn: bool) -> llama_cpp.Llama:  # noqa: ANN001
    return llama_cpp.Llama(model_path=str(path), n_ctx=CONFIG.n_ctx, n_threads=2,
                           n_threads_batch=2, n_batch=N_BATCH, n_ubatch=N_BATCH,
                           flash_attn=flash_attn,
                           type_k=llama_cpp.GGML_TYPE_Q8_0 if CONFIG.type_k == "q8_0" else None,
                           type_v=llama_cpp.GGML_TYPE_F16 if CONFIG.type_v == "f16" else None,
                           verbose=False)


def _one_token_at_a_time(llm: llama_cpp.Llama, prompt: list[int], eog: frozenset[int]
                         ) -> list[int]:
    """Greedy decoding as llama-cpp-python does it: the prompt in batches, then one
    token per decode, each chosen by llama.cpp's greedy sampler."""
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                            repeat_penalty=1.0, reset=True):
        if tok in eog:
            break
        out.append(tok)
        if len(out) >= MAX_TOKENS:
            break
    return out


@pytest.mark.parametrize("weights", ["q4_0", pytest.param("q4_k_m", marks=pytest.mark.slow),
                                     pytest.param("f32", marks=pytest.mark.slow)])
def test_plain_decoding_is_llama_cpp_decoding_one_token_at_a_time(weights, model_path,
                                                                  f32_model_path, quantized,
                                                                  dev_prompts):
    path = {"q4_0": model_path, "f32": f32_model_path}.get(weights) or quantized(weights)
    rows = pick_per_category(dev_prompts, 1)  # 13 prompts, one per category
    with Target(path, CONFIG) as target:
        prompts = [target.chat_prompt([{"role": "user", "content": r["turns"][0]}])
                   for r in rows]
        eog = target.model.eog_ids
        flash_attn = target.flash_attn  # the target's rule (off on this CPU)
        ours = []
        for prompt in prompts:
            target.reset()
            ours.append(generate(target, prompt, None, GenerationConfig(MAX_TOKENS)).tokens)
    llm = _llama_cpp_python(path, flash_attn)
    try:
        theirs = [_one_token_at_a_time(llm, prompt, eog) for prompt in prompts]
    finally:
        llm.close()
    differing = [r["category"] for r, a, b in zip(rows, ours, theirs, strict=True) if a != b]
    assert not differing, f"{weights}: Tandem's plain answer differs on {differing}"
    assert sum(len(a) for a in ours) > 13 * MAX_TOKENS // 2  # real answers, not empty ones
