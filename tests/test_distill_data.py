"""Self-distillation's feature extractor: conversations decoded side by side in one
context, each in its own KV sequence."""

from __future__ import annotations

from training.distill_data import BuildConfig, FeatureExtractor


def test_many_parallel_conversations_each_get_the_trained_context(model_path, dev_prompts):
    """16 conversations in parallel on the bundled model (trained context 8192): each
    sequence holds a whole long prompt and its answer. The context used to be clamped to
    the trained context in all, 512 cells a sequence, and a long prompt failed ('the batch
    needs 16 tokens but the context holds 8192', on the H200)."""
    config = BuildConfig(max_prompt_tokens=1024, max_answer_tokens=4, n_parallel=16)
    extractor = FeatureExtractor(model_path, config)
    try:
        target = extractor.target
        assert target.model.n_ctx_train == 8192 and target.n_ctx > 8192
        # A prompt longer than a 16th of 8192 tokens that fits the 1024 allowed.
        longest = next(r["turns"][0] for r in dev_prompts
                       if 600 < len(extractor.prompt_tokens(r["turns"][0])) <= 1000)
        n_long = len(extractor.prompt_tokens(longest))
        prompts = [longest, "Say hello.", longest]
        samples = list(extractor.self_samples(iter(prompts)))
    finally:
        extractor.close()
    assert sorted(len(s.tokens) for s in samples)[-1] > n_long
    assert len(samples) == 3
    for s in samples:
        assert len(s.features) == len(s.tokens) == len(s.target_next)
        assert 1 <= int(s.answer.sum()) <= 4
