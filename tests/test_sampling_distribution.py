"""Speculative sampling keeps the target's distribution, on the real model."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoding.acceptance import accept_coupled, accept_sampling
from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.sampling import SamplingParams, target_distribution
from engine.drafters.base import Drafter
from engine.runtime.draft_tree import DraftTree

from .stats_helpers import chi_square_z, two_sample_z

PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.mark.parametrize("coupled", [True, False], ids=["coupled", "rejection"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_p=0.9, top_k=40)],
                         ids=["t1", "t0.7-p0.9-k40"])
def test_first_token_after_forced_mismatch_follows_target_softmax(fresh_target, params,
                                                                  coupled):
    t = fresh_target
    pre = t.prefill(t.chat_prompt(PROMPT))
    root = int(np.argmax(pre.logits))
    # Children: the 1st and 3rd most likely tokens (often rejected), and a grandchild.
    order = np.argsort(-pre.logits)
    tree = DraftTree()
    ver_probe = t.verify(root, DraftTree())
    t.commit(ver_probe, [0], [root])
    t.rollback(t.n_past - 1)
    nxt = np.argsort(-ver_probe.logits[0])
    a = tree.add(int(nxt[0]), -1)
    tree.add(int(nxt[2]), -1)
    tree.add(int(order[0]), a)
    ver = t.verify(root, tree)
    logits = ver.logits.copy()
    t.commit(ver, [0], [root])
    dists = [target_distribution(row, params) for row in logits]
    p = dists[0]

    rng = np.random.default_rng(1234)
    n = 20000
    counts = np.zeros(t.n_vocab)
    node_tokens = [root] + tree.tokens
    children = tree.children()
    for _ in range(n):
        if coupled:  # what generation uses: one uniform per position
            acc = accept_coupled(children, node_tokens, dists.__getitem__,
                                 rng.random(4).__getitem__)
        else:
            acc = accept_sampling(children, node_tokens, dists.__getitem__, rng)
        first = node_tokens[acc.path[1]] if len(acc.path) > 1 else acc.next_token
        counts[first] += 1
    assert chi_square_z(counts, p * n) < 4.0
    # The check can fail: always accepting the first child is caught.
    biased = counts.copy()
    biased[int(nxt[0])] += n // 10
    assert chi_square_z(biased, p * n * 1.1) > 4.0


class GreedyOracleDrafter(Drafter):
    """Always proposes a fixed continuation: likely, so often accepted, often not."""

    name = "oracle"

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation
        self.n = 0

    def begin(self, context, features):
        self.n = 1

    def draft(self, max_tokens, token_time_s=0.0):
        tree = DraftTree.chain(self.continuation[self.n:self.n + 3])
        alt = (self.continuation[self.n] + 1) % 49152 if self.n < len(self.continuation) else 5
        tree.add(alt, -1)
        return tree.truncated(max_tokens)

    def accept(self, new_tokens, features):
        self.n += len(new_tokens)


def _second_token_counts(t, prompt, drafter, n_runs: int = 200):  # noqa: ANN001, ANN202
    """Second sampled token counts, plain and with ``drafter`` (other seeds), and how
    many draft tokens the drafter had verified."""
    plain = np.zeros(t.n_vocab)
    spec = np.zeros(t.n_vocab)
    n_drafted = 0
    params = dict(temperature=1.0, top_k=50)
    for seed in range(n_runs):
        cfg = GenerationConfig(max_tokens=3, sampling=SamplingParams(seed=seed, **params))
        out_p = generate(t, prompt, None, cfg).tokens
        cfg = GenerationConfig(max_tokens=3,
                               sampling=SamplingParams(seed=10_000 + seed, **params))
        # A fixed verification curve: what is drafted must not follow the machine's load.
        out_s = generate(t, prompt, drafter, cfg, remember=False,
                         cost=VerifyCostModel(slope=0.0, learn=False))
        n_drafted += sum(s.n_proposed for s in out_s.stats.steps)
        if len(out_p) > 1:
            plain[out_p[1]] += 1
        if len(out_s.tokens) > 1:
            spec[out_s.tokens[1]] += 1
    assert plain.sum() > 0.9 * n_runs and spec.sum() > 0.9 * n_runs
    return plain, spec, n_drafted


def test_end_to_end_sampling_matches_plain_sampling(fresh_target):
    t = fresh_target
    prompt = t.chat_prompt(PROMPT)
    greedy = generate(t, prompt, None, GenerationConfig(max_tokens=8)).tokens
    plain, spec, _ = _second_token_counts(t, prompt, GreedyOracleDrafter(greedy))
    assert two_sample_z(plain, spec) < 4.0


def test_memory_drafter_sampling_matches_plain_sampling(fresh_target):
    """The memory remembers the greedy answer, so it drafts it at every step; sampled
    output must still follow the target's distribution (second token compared)."""
    from engine.drafters.memory import MemoryDrafter

    t = fresh_target
    prompt = t.chat_prompt(PROMPT)
    greedy = generate(t, prompt, None, GenerationConfig(max_tokens=8)).tokens
    drafter = MemoryDrafter()
    drafter.memory.insert(prompt[-16:] + greedy)
    plain, spec, n_drafted = _second_token_counts(t, prompt, drafter)
    assert n_drafted > 150  # the memory's drafts really were verified
    assert two_sample_z(plain, spec) < 4.0


def test_a_seed_gives_the_same_answer_with_any_drafter(fresh_target):
    """Each answer position has its own uniform: sampled output with a seed is the same
    plain, with drafts from memory (which remember the first answer, so drafts differ
    from run to run) and with a head."""
    from engine.drafters import make_drafter
    from engine.drafters.memory import MemoryDrafter

    t = fresh_target
    prompt = t.chat_prompt(PROMPT)
    cfg = GenerationConfig(max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=7))
    plain = generate(t, prompt, None, cfg).tokens
    memory = MemoryDrafter()
    for drafter in (memory, memory, make_drafter("head", target=t)):
        t.reset()
        out = generate(t, prompt, drafter, cfg)
        assert out.tokens == plain
    assert out.stats.n_steps < len(plain)  # drafts were really accepted on the way
