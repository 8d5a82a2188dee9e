"""Plain greedy decoding in C (packaging/llama-cpp/greedy-run.patch): its argmax is numpy's,
and a run of tokens decoded there leaves the answer, the cache and the figures as Python's
token-at-a-time step does, wherever the run ends (an end of generation, a stop string, the
context, the answer's length)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.decoding import generation
from engine.decoding.generation import GenerationConfig, GenerationResult, generate
from engine.gguf.architectures import write_architecture_gguf
from engine.runtime.native import GreedyRun, native_argmax
from engine.runtime.target import Target, TargetConfig

CONFIG = TargetConfig(n_ctx=512, n_threads=2)
PROMPTS = ("Write a short poem about the sea.", "List three uses of copper.")


def test_the_build_has_the_loop() -> None:
    assert GreedyRun.available()  # `make install` applies the patch: a build without it is old


def _rows() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    rows = []
    for n in (1, 2, 15, 16, 17, 31, 33, 64, 1000, 49152, 151936):
        x = rng.standard_normal(n).astype(np.float32)
        rows.append(x)
        rows.append(np.round(x))  # many ties
        rows.append(np.full(n, -np.inf, np.float32))
        rows.append(np.where(x > 0, np.float32(0.0), np.float32(-0.0)))  # +0 and -0 tie
        for at in {0, n // 2, n - 1}:
            y = x.copy()
            y[at] = np.nan
            rows.append(y)
            z = x.copy()
            z[at] = np.inf
            z[-1] = np.inf  # two infinities: the first wins
            rows.append(z)
    return rows


def test_the_argmax_is_numpys_first_maximum() -> None:
    for row in _rows():
        assert native_argmax(row) == int(np.argmax(row)), (row.size, row[:4])


def _answer(target: Target, prompt: list[int], in_c: bool, config: GenerationConfig
            ) -> tuple[GenerationResult, list[int]]:
    target.reset(cold=True)
    target.greedy_in_c = in_c
    try:
        result = generate(target, prompt, None, config)
    finally:
        target.greedy_in_c = GreedyRun.available()
    target.settle()
    return result, list(target.tokens)


def _same(target: Target, prompt: list[int], config: GenerationConfig) -> GenerationResult:
    """The answer in C runs equals the token-at-a-time one: tokens, text, end, the cache's
    tokens and one step per decoded token (past a stop string, a run's extra ones too)."""
    c, c_cache = _answer(target, prompt, True, config)
    py, py_cache = _answer(target, prompt, False, config)
    assert c.tokens == py.tokens and c.text == py.text
    assert c.finish_reason == py.finish_reason
    assert c_cache == py_cache
    c_steps, py_steps = [s.n_past for s in c.stats.steps], [s.n_past for s in py.stats.steps]
    assert c_steps[:len(py_steps)] == py_steps
    assert len(c_steps) == len(py_steps) or c.finish_reason == "stop"
    return c


@pytest.mark.parametrize("weights", ["q4_0", "q4_k_m", "q6_k"])
def test_runs_in_c_equal_a_token_at_a_time(weights: str, model_path: Path, quantized
                                           ) -> None:
    path = model_path if weights == "q4_0" else quantized(weights)
    with Target(path, CONFIG) as target:
        for text in PROMPTS:
            prompt = target.chat_prompt([{"role": "user", "content": text}])
            result = _same(target, prompt, GenerationConfig(max_tokens=40))
            # Several tokens a run: their steps are reported after it, the last at once.
            assert any(s.reported_after_s > 0 for s in result.stats.steps)
            assert result.stats.steps[-1].reported_after_s == 0


def test_a_run_ends_at_an_end_of_generation_a_stop_string_and_the_context(
        target: Target) -> None:
    prompt = target.chat_prompt([{"role": "user", "content": PROMPTS[0]}])
    free, _ = _answer(target, prompt, False, GenerationConfig(max_tokens=48))
    words = free.text.split()
    assert len(words) > 8
    # A stop string inside a run: the tokens decoded past it are taken back.
    stopped = _same(target, prompt, GenerationConfig(max_tokens=48, stop=(words[6],)))
    assert stopped.finish_reason == "stop"
    # An end of generation inside a run: chosen, not decoded.
    end = next(i for i in range(10, 40) if free.tokens[i] not in free.tokens[:i])
    kept = target.model.eog_ids
    target.model.eog_ids = frozenset({free.tokens[end]})
    try:
        ended = _same(target, prompt, GenerationConfig(max_tokens=48))
    finally:
        target.model.eog_ids = kept
    assert ended.finish_reason == "eos" and ended.tokens == free.tokens[:end]
    # The answer's length and the context's end fall inside runs.
    assert len(_same(target, prompt, GenerationConfig(max_tokens=23)).tokens) == 23
    with Target(target.path, TargetConfig(n_ctx=256, n_threads=2)) as small:
        count = small.tokenize(", ".join(str(i) for i in range(1, 300)), special=False)
        long = count[:small.n_ctx - 19]  # counting on, with 19 cells left for it
        full = _same(small, long, GenerationConfig(max_tokens=48))
    assert full.finish_reason == "context" and len(full.tokens) == 19 + 1  # + the unread last


def test_runs_stay_short_enough_to_stream(target: Target, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """A run is about PLAIN_RUN_SECONDS of tokens: at most PLAIN_RUN_MAX_TOKENS, and one
    token when a token takes longer than that."""
    prompt = target.chat_prompt([{"role": "user", "content": PROMPTS[1]}])
    result, _ = _answer(target, prompt, True, GenerationConfig(max_tokens=40))
    runs = sum(1 for s in result.stats.steps if s.reported_after_s == 0)
    assert len(result.stats.steps) / runs <= generation.PLAIN_RUN_MAX_TOKENS
    monkeypatch.setattr(generation, "PLAIN_RUN_SECONDS", 1e-6)
    result, _ = _answer(target, prompt, True, GenerationConfig(max_tokens=12))
    assert all(s.reported_after_s == 0 for s in result.stats.steps)


def test_a_hybrid_with_a_stop_string_decodes_a_token_at_a_time(model_path: Path,
                                                                tmp_path: Path) -> None:
    """Recurrent state goes back only within its last batch: where a stop string may end
    the answer inside a run, a run is one token, so nothing decoded past the stop has to
    be taken back."""
    path = write_architecture_gguf("lfm2", tmp_path / "lfm2.gguf", model_path)
    with Target(path, TargetConfig(n_ctx=256, n_threads=2)) as target:
        assert target.arch.has_state
        prompt = target.tokenize("Count with me: one two three four", special=False)
        free = _same(target, prompt, GenerationConfig(max_tokens=24))
        assert any(s.reported_after_s > 0 for s in free.stats.steps)
        middle = len(free.text) // 2
        stopped = _same(target, prompt,
                        GenerationConfig(max_tokens=24, stop=(free.text[middle:middle + 2],)))
        assert stopped.finish_reason == "stop"
        assert all(s.reported_after_s == 0 for s in stopped.stats.steps)


def test_a_decode_failing_mid_run_keeps_the_tokens_before_it_then_fails(target: Target
                                                                         ) -> None:
    """A real failure inside a run: llama.cpp's abort callback stops the graph of the run's
    fourth decode, and llama_decode returns 2 (aborted). The three tokens chosen before it
    come back; the next call raises that failure as a token-at-a-time step would, without
    decoding again; and the next prompt's answer is plain decoding's."""
    import llama_cpp

    from engine.errors import NativeError

    prompt = target.chat_prompt([{"role": "user", "content": PROMPTS[1]}])
    plain, _ = _answer(target, prompt, True, GenerationConfig(max_tokens=12))
    calls, limit = [0], [None]

    @llama_cpp.ggml_abort_callback
    def abort(_data: object) -> bool:  # called between graph nodes, on one thread
        calls[0] += 1
        return limit[0] is not None and calls[0] > limit[0]

    llama_cpp.llama_set_abort_callback(target.ctx.handle, abort, None)
    try:
        target.reset(cold=True)
        target.prefill(prompt)
        calls[0] = 0
        assert target.decode_greedy(plain.tokens[0], 1)[0] == plain.tokens[1:2]
        per_decode = calls[0]
        assert per_decode > 0
        target.reset(cold=True)
        target.prefill(prompt)
        calls[0], limit[0] = 0, 3 * per_decode + per_decode // 2
        chosen, _ = target.decode_greedy(plain.tokens[0], 8)
        assert chosen == plain.tokens[1:4]  # the fourth decode was aborted
        assert target.tokens[-3:] == plain.tokens[:3]
        limit[0], seen = None, calls[0]
        with pytest.raises(NativeError) as failed:
            target.decode_greedy(chosen[-1], 8)
        assert failed.value.code == 2 and calls[0] == seen  # raised, not decoded again
    finally:
        llama_cpp.llama_set_abort_callback(target.ctx.handle,
                                           llama_cpp.ggml_abort_callback(), None)
    again, _ = _answer(target, prompt, True, GenerationConfig(max_tokens=12))
    assert again.tokens == plain.tokens
