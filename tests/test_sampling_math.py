"""Sampling and acceptance maths, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoding.acceptance import accept_greedy, accept_one_level, accept_sampling
from engine.decoding.sampling import SamplingParams, sample, target_distribution
from engine.errors import InvalidSamplingError


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"top_k": 2.5}, {"seed": -3},
])
def test_invalid_sampling_values_are_refused(kwargs):
    with pytest.raises(InvalidSamplingError):
        SamplingParams(**kwargs)


def test_greedy_distribution_is_one_hot_of_argmax():
    logits = np.array([0.1, 3.0, 3.0, -1.0], dtype=np.float32)
    p = target_distribution(logits, SamplingParams())
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_top_k_top_p():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32) * 3
    full = target_distribution(logits, SamplingParams(temperature=0.7))
    z = logits.astype(np.float64) / 0.7
    ref = np.exp(z - z.max())
    np.testing.assert_allclose(full, ref / ref.sum(), rtol=1e-5)

    k = target_distribution(logits, SamplingParams(temperature=1.0, top_k=5))
    assert np.count_nonzero(k) == 5
    assert set(np.flatnonzero(k)) == set(np.argsort(-logits)[:5])

    p = target_distribution(logits, SamplingParams(temperature=1.0, top_p=0.9))
    base = target_distribution(logits, SamplingParams(temperature=1.0))
    kept = np.flatnonzero(p)
    order = np.argsort(-base)
    n = len(kept)
    assert set(kept) == set(order[:n])  # the most likely tokens
    assert base[order[:n]].sum() >= 0.9 > base[order[:n - 1]].sum()  # and the fewest
    assert p.sum() == pytest.approx(1.0)


def test_sample_follows_distribution():
    rng = np.random.default_rng(1)
    p = np.array([0.5, 0.0, 0.3, 0.2])
    draws = np.bincount([sample(p, rng) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(draws, p, atol=0.015)
    assert draws[1] == 0


def test_greedy_acceptance_walks_the_argmax_path():
    # root -> (5 | 6), 5 -> 7 ; target argmax: after root 5, after 5 8
    children = [[1, 2], [3], [], []]
    tokens = [0, 5, 6, 7]
    logits = np.zeros((4, 10))
    logits[0, 5] = 1
    logits[1, 8] = 1
    acc = accept_greedy(children, tokens, logits.__getitem__)
    assert acc.path == [0, 1] and acc.next_token == 8


def _output_distribution(p, candidates, n, seed):
    rng = np.random.default_rng(seed)
    counts = np.zeros_like(p)
    for _ in range(n):
        j, residual = accept_one_level(p, candidates, rng)
        tok = candidates[j] if j is not None else sample(residual, rng)
        counts[tok] += 1
    return counts / n


@pytest.mark.parametrize("candidates", [[2], [0, 2], [3, 1, 0], [4]])
def test_recursive_rejection_keeps_the_target_distribution(candidates):
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    got = _output_distribution(p, candidates, 40000, seed=sum(candidates))
    np.testing.assert_allclose(got, p, atol=0.01)


def test_sampling_acceptance_over_a_tree_keeps_the_distribution():
    """Two levels: the joint law of (first, second) token matches the target's."""
    rng = np.random.default_rng(7)
    v = 4
    logits = rng.normal(size=(4, v))
    # root -> children 1 (token 0), 2 (token 1); node 1 -> child 3 (token 2)
    children = [[1, 2], [3], [], []]
    tokens = [9, 0, 1, 2]
    params = SamplingParams(temperature=1.0)
    dists = [target_distribution(row, params) for row in logits]
    p0, p_after_0 = dists[0], dists[1]
    n = 30000
    first = np.zeros(v)
    second_given_0 = np.zeros(v)
    for _ in range(n):
        acc = accept_sampling(children, tokens, dists.__getitem__, rng)
        out = [tokens[k] for k in acc.path[1:]] + [acc.next_token]
        first[out[0]] += 1
        if out[0] == 0:
            second_given_0[out[1]] += 1
    np.testing.assert_allclose(first / n, p0, atol=0.01)
    np.testing.assert_allclose(second_given_0 / second_given_0.sum(), p_after_0, atol=0.015)
