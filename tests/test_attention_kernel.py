"""The CPU library's attention kernel (packaging/llama-cpp/tiled-attention.patch) gives a
query row the same bits in a batch of any size, with any thread count, over a cut or a
padded cache, and stays within 1e-4 of float64 attention (engine.runtime.attention_check;
``tandem check-cpu`` runs the same check on every CPU level of a portable build)."""

from __future__ import annotations

import pytest

from engine.runtime.attention_check import BATCHES, THREADS, check_attention, kernel_available


@pytest.fixture(autouse=True)
def _built() -> None:
    assert kernel_available(), "the CPU library was built without tiled-attention.patch"


@pytest.mark.parametrize("k_type", ["q8_0", "f16"])
def test_every_row_is_the_same_bits_in_every_batch_and_thread_count(k_type: str) -> None:
    check = check_attention(k_type)
    assert check.status == "exact", (check.status, check.differing, check.max_gap)
    assert check.max_gap < 1e-4


def test_the_check_catches_ggml_s_own_paths() -> None:
    """Stock ggml with a float cache: one token over 512+ cells takes the split-KV path,
    whose chunks move with the thread count, and 64 rows the tiled one: rows differ. And
    its one-row path sums V in F16, far from float64: the check sees both."""
    stock = check_attention("f16", batches=(1, 64), threads=(1, 2), switch_on=False)
    assert stock.status == "differs" and stock.differing
    quantized = check_attention("q8_0", batches=(1, 8), threads=(1,), switch_on=False)
    assert quantized.max_gap > 1e-3


def test_the_switch_is_left_as_it_was() -> None:
    from engine.runtime.attention_check import _ggml

    g = _ggml()
    before = bool(g.is_on())
    check_attention("q8_0", batches=(1, 2), threads=(1,))
    assert bool(g.is_on()) == before
    assert BATCHES == (1, 2, 3, 5, 8, 16, 31, 64) and THREADS == (1, 2, 3, 4)
