"""The long-context bench's prompts and memory readings (app.benchmarks.long_context):
sizes the model's context holds, cuts at a line's end, and a real process's peak."""

from __future__ import annotations

import os

import pytest

from app.benchmarks.long_context import (
    LONG_SIZES,
    bench_context,
    cut_lines,
    long_prompts,
    long_text,
    peak_bytes,
    prompt_sizes,
    reset_peak,
)


def _words(text: str) -> int:
    return len(text.split())


def test_sizes_are_those_the_trained_context_holds_with_the_answer() -> None:
    # An 8k model: 2k whole, 8k filled up to the answer, 16k and 32k left out.
    sizes = prompt_sizes(8192, 128)
    assert [s for s, _ in sizes] == [2048, 8192]
    assert sizes[1][1] == 8192 - 128 - 96
    assert bench_context(8192, 128, LONG_SIZES) == 8192
    assert [s for s, _ in prompt_sizes(40960, 128)] == list(LONG_SIZES)
    assert bench_context(40960, 128, LONG_SIZES) == 32768 + 128 + 96
    with pytest.raises(ValueError, match="holds none"):
        bench_context(1024, 128, LONG_SIZES)


def test_a_document_is_cut_at_a_lines_end_within_the_count() -> None:
    text = long_text()
    assert _words(text) > 32768  # enough for the largest size, by any tokenizer's count
    cut = cut_lines(text, 500, _words)
    assert _words(cut) <= 500 and text.startswith(cut) and text[len(cut)] == "\n"
    assert _words(cut_lines(text, 501, _words)) >= _words(cut)  # the longest such start


def test_prompts_carry_the_document_and_the_question(target) -> None:  # noqa: ANN001
    def count(text: str) -> int:
        return len(target.tokenize(text, special=False))

    prompts = long_prompts(count, 2400, 128, (2048,))
    assert [p.category for p in prompts] == ["ctx-2k"]
    tokens = target.chat_prompt([{"role": "user", "content": prompts[0].turns[0]}])
    assert 1900 <= len(tokens) <= 2048 + 128


def test_the_peak_is_this_processs_and_starts_again_from_now() -> None:
    pid = os.getpid()
    reset_peak(pid)
    before = peak_bytes(pid)
    block = bytearray(64 * 2**20)  # touched: 64 MiB resident
    assert peak_bytes(pid) >= before + 60 * 2**20
    del block
    reset_peak(pid)
    assert peak_bytes(pid) < before + 60 * 2**20
