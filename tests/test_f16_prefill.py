"""Long prompts prefilled in an F16 context and moved into the Q8_0-K cache."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.errors import NativeError
from engine.runtime import kv_transfer
from engine.runtime.draft_tree import DraftTree
from engine.runtime.f16_prefill import F16_PREFILL_MIN_TOKENS, F16Prefill
from engine.runtime.native import NativeContext
from engine.runtime.target import Target, TargetConfig
from tests.conftest import follow_up_with_features


@pytest.fixture(scope="module")
def target(model_path):
    """A target with flash attention, whose long prompts go through the F16 context
    (without it the target's own cache reads them: the last test here)."""
    with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2, flash_attn=True)) as t:
        yield t


@pytest.fixture(scope="module")
def long_prompts(target, dev_prompts) -> list[list[int]]:
    """Rag and summarization prompts: 600-800 tokens, past llama.cpp's 512-cell split."""
    prompts = []
    for category in ("rag", "summarization"):
        rows = [r for r in dev_prompts if r["category"] == category]
        prompts += [p for r in rows
                    if len(p := target.chat_prompt([{"role": "user", "content": r["turns"][0]}]))
                    > 512][:1]
    assert len(prompts) == 2
    return prompts


def _dequantize_q8_0(rows: np.ndarray) -> np.ndarray:
    return dequantize(rows, GGMLQuantizationType.Q8_0)


def _layer0_keys(blob: bytes, row_bytes: int) -> np.ndarray:
    n_cells = int.from_bytes(blob[12:16], "little")
    at = 16 + 12 * n_cells + 8 + 12  # cells, then v_trans and n_layer, then K's header
    return np.frombuffer(blob, np.uint8, n_cells * row_bytes, at).reshape(n_cells, row_bytes)


def test_moved_keys_are_stored_as_llama_cpp_stores_them(target, long_prompts):
    """Layer 0's keys do not depend on attention: rotated and quantized here, they equal
    the keys llama.cpp writes into its own Q8_0 cache, up to one quantization step."""
    prompt = long_prompts[0][:250]
    target.reset()
    target.f16_prefill_off = "test"
    try:
        target.prefill(prompt)
    finally:
        target.f16_prefill_off = None
    target.settle()
    own = _dequantize_q8_0(_layer0_keys(target.ctx.state_seq_get(0), 204))
    with NativeContext(target.model, n_ctx=512, n_batch=256, n_seq_max=1, n_threads=2,
                       features=False, type_k="f16", type_v="f16") as f16:
        target.batch.fill(prompt, list(range(len(prompt))), None, False)
        f16.decode(target.batch)
        blob = f16.state_seq_get(0)
    n_head_kv = target.model.n_head_kv
    ours = _dequantize_q8_0(_layer0_keys(kv_transfer.f16_to_q8_0_keys(blob, n_head_kv, True),
                                         204))
    unrotated = _dequantize_q8_0(_layer0_keys(
        kv_transfer.f16_to_q8_0_keys(blob, n_head_kv, False), 204))
    step = np.abs(own).max() / 127
    assert np.abs(ours - own).max() <= 2 * step
    assert np.abs(unrotated - own).max() > 20 * step  # the rotation is what makes them equal


def test_first_token_logits_close_to_the_q8_0_prefill(target, long_prompts):
    for prompt in long_prompts:
        target.reset()
        moved = target.prefill(prompt).logits
        target.reset()
        target.f16_prefill_off = "test"
        try:
            own = target.prefill(prompt).logits
        finally:
            target.f16_prefill_off = None
        assert moved.argmax() == own.argmax()
        assert 0 < np.abs(moved - own).max() < 3.0  # F16 attention in the prompt, not Q8_0


def test_a_prompts_cells_do_not_depend_on_the_f16_contexts_history(model_path, long_prompts):
    """Chunks start at multiples of n_batch, so a prompt gets the same cells whether the
    F16 context held a shorter version of it or nothing."""
    prompt = long_prompts[1]
    with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2, flash_attn=True)) as cold:
        cold.prefill(prompt)
        cold.settle()
        want = cold.ctx.state_seq_get(0)
    with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2, flash_attn=True)) as warm:
        warm.prefill(prompt[:300])
        warm.reset()
        warm.prefill(prompt)
        warm.settle()
        assert warm.ctx.state_seq_get(0) == want


def test_a_cold_reset_empties_the_f16_context_too(target, long_prompts):
    """reset() keeps the F16 context's prompt (a regenerate only moves its cells);
    reset(cold=True), the benchmark's, forgets it, so the prompt is prefilled again."""
    prompt = long_prompts[0]
    target.reset(cold=True)
    target.prefill(prompt)
    target.settle()
    want = target.ctx.state_seq_get(0)
    target.reset()
    assert target.prompts.f16.ctx.kv_pos_max(0) == len(prompt) - 1  # the whole prompt
    target.reset(cold=True)
    assert target.prompts.f16.ctx.kv_pos_max(0) == -1
    target.prefill(prompt)
    target.settle()
    assert target.ctx.state_seq_get(0) == want


def test_features_of_a_long_prompt_leave_its_cells_as_plain_prefill_makes_them(
        target, long_prompts):
    """The head's prompt features are evaluated again beside the prompt (sequence 1),
    so asking for them changes neither the cells nor the first token's logits, and they
    are the features a prefill of the whole prompt in features mode gives."""
    prompt = long_prompts[0]
    target.reset()
    plain = target.prefill(prompt)
    target.settle()
    plain_cells = target.ctx.state_seq_get(0)
    target.reset()
    target.set_features(True)
    try:
        tail = target.prefill(prompt, feature_tail=8)
        target.settle()
        cells = target.ctx.state_seq_get(0)
        assert target.prompts.f16.ctx.kv_pos_max(1) == -1  # sequence 1 is empty again
        target.reset()
        target.f16_prefill_off = "test"
        try:
            whole = target.prefill(prompt, feature_tail=None).features
        finally:
            target.f16_prefill_off = None
    finally:
        target.set_features(False)
    assert cells == plain_cells
    np.testing.assert_array_equal(tail.logits, plain.logits)
    assert tail.features.shape == (8, target.n_embd)
    cos = (tail.features * whole[-8:]).sum(1) / (
        np.linalg.norm(tail.features, axis=1) * np.linalg.norm(whole[-8:], axis=1))
    assert cos.min() > 0.99, cos  # F16 attention over the prompt here, Q8_0 there


def test_greedy_after_a_long_second_turn_equals_plain(target, dev_prompts):
    """A short first turn, then a long document: the second prompt's new part goes
    through the F16 context onto a warm cache; drafted output equals plain."""
    from engine.drafters.lookup import PromptLookupDrafter
    from engine.drafters.memory import MemoryDrafter

    doc = next(r for r in dev_prompts if r["category"] == "summarization")["turns"][0]
    first_messages = [{"role": "user", "content": "Say hello in French."}]
    first_prompt = target.chat_prompt(first_messages)
    outputs = {}
    for name, drafter in (("plain", None), ("lookup", PromptLookupDrafter()),
                          ("memory", MemoryDrafter())):
        target.reset()
        first = generate(target, first_prompt, drafter, GenerationConfig(20)).tokens
        messages = first_messages + [{"role": "assistant", "content": target.detokenize(first)},
                                     {"role": "user", "content": doc}]
        second_prompt = target.chat_prompt(messages)
        # a fixed verification curve: one learnt under load can decline every draft
        out = generate(target, second_prompt, drafter, GenerationConfig(60),
                       cost=VerifyCostModel(slope=0.35, learn=False))
        assert len(second_prompt) - out.stats.n_prompt_reused > F16_PREFILL_MIN_TOKENS
        if drafter is not None:  # the summary drafted from the document
            assert sum(s.n_accepted for s in out.stats.steps) > 0, name
        outputs[name] = (first, out.tokens)
    assert target.f16_prefill_off is None
    assert outputs["lookup"] == outputs["plain"] == outputs["memory"]


def test_a_chats_next_turn_does_not_evaluate_the_last_answer_again(target, model_path):
    """The F16 context holds the prompts it prefilled, not the answers: after a long
    answer, a long next message goes straight into the cache (through the F16 context
    it took 2.5x as long), and its logits are those of a target without F16 prefill."""
    essay = [{"role": "user", "content": "Write a detailed essay about the history of the "
                                         "printing press in Europe."}]
    follow_up = " ".join(["Now rewrite the essay for children, keeping these points: movable "
                          "type, Gutenberg, Mainz, the Bible, paper, ink, literacy, the "
                          "Reformation, newspapers, science."] * 4)

    def second_turn(t: Target) -> tuple[list[int], np.ndarray]:
        t.reset(cold=True)
        answer = generate(t, t.chat_prompt(essay), None, GenerationConfig(300)).tokens
        messages = essay + [{"role": "assistant", "content": t.detokenize(answer)},
                            {"role": "user", "content": follow_up}]
        prompt = t.chat_prompt(messages)
        assert len(answer) >= 200 and len(prompt) - t.n_past >= F16_PREFILL_MIN_TOKENS
        held = list(t.prompts.f16.tokens)
        logits = t.prefill(prompt).logits
        assert t.prompts.f16.tokens == held  # the F16 context was not used
        return answer, logits

    answer, logits = second_turn(target)
    own = TargetConfig(n_ctx=2048, n_threads=2, f16_prefill=False, flash_attn=True)
    with Target(model_path, own) as t:
        want_answer, want_logits = second_turn(t)
    assert answer == want_answer
    np.testing.assert_array_equal(logits, want_logits)


def test_features_that_fail_in_the_f16_context_leave_f16_prefill_on(target, long_prompts,
                                                                    monkeypatch, caplog):
    """The features a drafter asks of a long prompt fail in the F16 context: the prompt
    was read as plain decoding reads it, so F16 prefill stays on (before: off for the rest
    of that drafted session alone, whose later prompts plain decoding then read
    otherwise) and the features come from the moved cells."""
    prompt = long_prompts[0]
    target.reset()
    plain = target.prefill(prompt)
    target.reset()

    def fail(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise NativeError("llama_decode", 1, "test: no memory for the features")

    monkeypatch.setattr(F16Prefill, "_f16_features_again", fail)
    target.set_features(True)
    try:
        with caplog.at_level(logging.WARNING, logger="engine.runtime.prefill"):
            got = target.prefill(prompt, feature_tail=8)
    finally:
        target.set_features(False)
    assert "features were not evaluated in the F16 context" in caplog.text
    assert target.f16_prefill_off is None
    np.testing.assert_array_equal(got.logits, plain.logits)
    assert got.features.shape == (8, target.n_embd)


def test_a_failed_move_falls_back_to_the_q8_0_prefill(model_path, long_prompts, monkeypatch,
                                                      caplog):
    """A blob llama.cpp refuses: the prompt's tokens are evaluated here instead, with a
    warning, and the next token is computed as a target without F16 prefill computes it
    (the first one was already chosen from the F16 prefill's logits)."""
    prompt = long_prompts[0]
    own = TargetConfig(n_ctx=2048, n_threads=2, f16_prefill=False, flash_attn=True)
    with Target(model_path, own) as t:
        want_first = t.prefill(prompt).logits
        first = int(want_first.argmax())
        want_next = t.verify(first, DraftTree()).logits[0].copy()
    real = kv_transfer.f16_to_q8_0_keys
    monkeypatch.setattr("engine.runtime.f16_prefill.f16_to_q8_0_keys",
                        lambda blob, *a, **k: real(blob, *a, **k)[:-1000])  # cut short
    with Target(model_path, TargetConfig(n_ctx=2048, n_threads=2, flash_attn=True)) as t:
        with caplog.at_level(logging.WARNING, logger="engine.runtime.prefill"):
            got_first = t.prefill(prompt).logits
            assert not caplog.text  # the move waits for the first use of the cache
            assert int(got_first.argmax()) == first
            t.settle()
            assert t.n_past == len(prompt) and t.ctx.kv_pos_max(0) == len(prompt) - 1
        assert t.f16_prefill_off and "llama_state_seq_set_data" in t.f16_prefill_off
        assert "F16 prefill off" in caplog.text
        assert t.ctx.kv_pos_max(1) == -1
        np.testing.assert_array_equal(t.verify(first, DraftTree()).logits[0], want_next)


def test_the_first_token_does_not_wait_for_the_cells_to_move(target, long_prompts):
    """The prefill's logits come before the move; ``settle`` (which every use of the
    cache calls first) moves the cells, and they are the ones an immediate move wrote."""
    prompt = long_prompts[1]
    target.reset(cold=True)
    target.prefill(prompt)
    assert target.ctx.kv_pos_max(0) == -1  # still in the F16 context
    target.settle()
    moved = target.ctx.state_seq_get(0)
    assert target.ctx.kv_pos_max(0) == len(prompt) - 1
    target.reset()  # a reset forgets cells not moved yet
    target.prefill(prompt)
    target.reset()
    assert target.ctx.kv_pos_max(0) == -1 and target.n_past == 0
    target.prefill(prompt)
    target.settle()
    assert target.ctx.state_seq_get(0) == moved


def test_blobs_of_another_layout_are_refused(target, long_prompts):
    target.reset()
    target.f16_prefill_off = "test"
    try:
        target.prefill(long_prompts[0][:200])
    finally:
        target.f16_prefill_off = None
    target.settle()
    q8_blob = target.ctx.state_seq_get(0)  # K already Q8_0
    with pytest.raises(kv_transfer.StateFormatError, match="not F16"):
        kv_transfer.f16_to_q8_0_keys(q8_blob, target.model.n_head_kv, rotate=True)
    with pytest.raises(kv_transfer.StateFormatError, match="ends"):
        kv_transfer.f16_to_q8_0_keys(q8_blob[:40], target.model.n_head_kv, rotate=True)


def test_rotation_and_quantization_reference():
    h = kv_transfer.hadamard(64)
    assert np.allclose(h @ h, np.eye(64), atol=1e-6) and np.allclose(h, h.T)
    assert [kv_transfer.rotation_size(d) for d in (64, 96, 128, 192, 256)] == [64, 0, 128, 64, 256]
    rows = np.random.default_rng(1).normal(size=(7, 512)).astype(np.float32)
    for block in (64, 128, 256, 512):  # the factored rotation is the block's product
        whole = (rows.reshape(-1, block) @ kv_transfer.hadamard(block)).reshape(rows.shape)
        np.testing.assert_allclose(kv_transfer.rotate_blocks(rows, block), whole, atol=1e-5)
    x = np.random.default_rng(0).normal(size=(5, 64)).astype(np.float32)
    packed = quantize(x, GGMLQuantizationType.Q8_0)  # gguf's reference, the fallback
    assert packed.shape == (5, 68)
    assert np.abs(_dequantize_q8_0(packed) - x).max() <= np.abs(x).max() / 127
    kernels = kv_transfer.ggml_row_kernels()
    if kernels is not None:  # ggml's own kernel writes the same bytes
        assert np.array_equal(kernels.quantize_q8_0(x), packed)


def test_a_regenerate_gets_the_first_tokens_logits_again(target, long_prompts):
    """A prompt the F16 context holds whole (a regenerate) still yields the last token's
    logits: its chunk is evaluated again, also when the prompt ends on a chunk boundary."""
    step = target.config.n_batch
    for prompt in (long_prompts[0], long_prompts[0][:2 * step]):
        target.reset(cold=True)
        cold = target.prefill(prompt)
        target.settle()
        cells = target.ctx.state_seq_get(0)
        target.reset()
        target.set_features(True)  # its outputs are another batch's: no stale logits
        try:
            target.prefill(prompt, feature_tail=8)
        finally:
            target.set_features(False)
        target.reset()
        warm = target.prefill(prompt)
        np.testing.assert_array_equal(warm.logits, cold.logits)
        target.settle()
        assert target.ctx.state_seq_get(0) == cells


def test_a_prompt_asked_again_with_its_answer_cached_answers_the_same(target, long_prompts):
    """The same prompt again while the main cache still holds it and its answer (a
    regenerate without a reset): the first token's logits are the F16 prefill's again,
    not a decode of the last prompt token over the Q8_0 cells, which chose another first
    token on one of 13 dev prompts. With a drafter too: drafted equals plain."""
    from engine.decoding.generation import GenerationConfig, generate
    from engine.drafters.lookup import LookupConfig, PromptLookupDrafter

    accepted = 0
    for prompt in long_prompts:
        target.reset(cold=True)
        first = target.prefill(prompt)
        target.prefill(prompt + [int(np.argmax(first.logits))] * 3)  # an answer after it
        again = target.prefill(prompt)
        np.testing.assert_array_equal(again.logits, first.logits)
        assert again.n_reused == len(prompt) and target.tokens == prompt
        target.reset(cold=True)
        plain = generate(target, prompt, None, GenerationConfig(16)).tokens
        drafted = generate(target, prompt, PromptLookupDrafter(LookupConfig()),
                           GenerationConfig(16), cost=VerifyCostModel(slope=0.35, learn=False))
        assert drafted.tokens == plain == generate(target, prompt, None,
                                                   GenerationConfig(16)).tokens
        accepted += sum(s.n_accepted for s in drafted.stats.steps)
    assert accepted > 0  # the answers drafted from their rag and summarization prompts


def test_the_moves_buffer_is_made_when_the_target_opens_and_kept(target, long_prompts):
    """Its pages are touched while the model opens, not before a long prompt's second
    token; a prompt of 1024 tokens fits it, and every move uses it again."""
    made = target.prompts.f16.move_buffer
    assert made is not None
    for prompt in long_prompts:
        target.reset(cold=True)
        target.prefill(prompt)
        target.settle()
        assert target.f16_prefill_off is None and target.prompts.f16.move_buffer is made
        f16 = target.prompts.f16.ctx
        f16.kv_copy(0, 1, 0, -1)
        try:
            blob_bytes = len(f16.state_seq_array(1))
        finally:
            f16.kv_remove(1, -1, -1)
        # What a 1024-token prompt needs, by this prompt's bytes per token.
        assert made.nbytes >= blob_bytes / len(prompt) * 1024


def test_a_regenerate_with_features_gets_plain_decodings_first_token(target, long_prompts):
    """A short follow-up read in the target's own cache keeps the features of the tokens
    it evaluated, fewer than a drafter asks for: asked again (a regenerate), it still
    gets the first token's logits plain decoding got, not a decode of its last token
    alone, and the features it asks for."""
    if not target.prompts.fast_prompts:
        pytest.skip("this build lacks the prompt kernels: nothing is remembered")
    base, follow = long_prompts[0][:100], long_prompts[1][:9]
    prompt = base + follow
    plain, (first, again) = follow_up_with_features(target, base, prompt, again=True)
    np.testing.assert_array_equal(first.logits, plain)
    np.testing.assert_array_equal(again.logits, plain)
    assert again.features is not None and len(again.features) == 32
    assert again.n_reused == len(prompt)


def test_features_near_the_contexts_end_do_not_refuse_a_prompt_that_fits(model_path):  # noqa: ANN001
    """A short follow-up a few cells before the context's end, with a feature drafter's
    tail: the features evaluated again beside the prompt take only the free cells, so the
    prompt is read as plain decoding reads it, not refused (the differential test found
    a ContextFullError here)."""
    with Target(model_path, TargetConfig(n_ctx=256, n_threads=2, flash_attn=True)) as t:
        words = t.tokenize(" the sea and the lighthouse" * 60, special=False)
        plain, (drafted,) = follow_up_with_features(t, words[:240], words[:250])
        np.testing.assert_array_equal(drafted.logits, plain)
        assert drafted.features is not None and 1 <= len(drafted.features) <= 256 - 250


def test_a_target_without_flash_attention_reads_prompts_in_its_own_cache(model_path,
                                                                         long_prompts):
    """Without flash attention (the CPU's default) a long prompt is read in the target's
    own cache: no F16 context is opened, no cells wait to move after the first token, and
    its logits are the ones a target told to read there gets."""
    config = TargetConfig(n_ctx=2048, n_threads=2, flash_attn=False)
    with Target(model_path, config) as own:
        assert not own.flash_attn and own.prompts.f16.ctx is None
        assert "flash attention" in (own.f16_prefill_off or "")
        logits = own.prefill(long_prompts[0]).logits.copy()
        assert own.sequence._pending is None  # nothing to move
    with Target(model_path, replace(config, f16_prefill=False)) as asked:
        assert np.array_equal(asked.prefill(long_prompts[0]).logits, logits)

