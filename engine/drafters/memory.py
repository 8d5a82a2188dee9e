"""A drafter with memory: propose what followed the context's suffix in this prompt or in
anything the model wrote before (SuffixDecoding, arXiv 2411.04975).

Two ``SuffixIndex`` sources feed one tree: the generation's own prompt and answer (like
prompt lookup, but frequency-scored), and a per-model memory of earlier answers and the
turns that led to them (``finish`` adds each generation; the caller saves it to disk), so
a question asked again, a template answered before or boilerplate code drafts from the
earlier text. Needs no weights; drafting costs tens of microseconds.

A node's score starts as the empirical conditional frequency of its token among the
earlier continuations, times a learnt calibration per (where the match was, match length,
depth): how often such nodes were accepted relative to their frequency. Where the match
was matters: an answer repeating itself (a model looping) goes on far more reliably than
a summary copying its prompt, which drifts off after a few tokens. A ``LocalCalibration``
then follows this conversation, so the scores become acceptance probabilities the budget
(``engine.decoding.budget``) can trust. Learnt rates survive across generations of one drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.drafters.base import Drafter
from engine.drafters.kinds import DrafterKind
from engine.drafters.lookup import AcceptanceRates, LocalCalibration
from engine.drafters.suffix_index import IndexConfig, Speculation, SuffixIndex
from engine.runtime.draft_tree import DraftTree

REQUEST, MEMORY = 0, 1  # the two indexes
# Where a match was found, in the calibration key: this request's prompt, this answer
# (the model repeating itself), or the memory of earlier answers.
PROMPT, ANSWER, EARLIER = 0, 1, 2
RateKey = tuple[int, int, int]  # (where, match-length bucket, depth bucket)
_LOCAL_DEPTH = 2  # the conversation's local factor scales the first levels only
_DEPTH_TOPS = (1, 2, 3, 5, 8, 16)  # depth buckets: 1, 2, 3, 4-5, 6-8, 9-16, 17+
_MATCH_TOPS = (2, 3, 5, 8, 12, 20)  # match-length buckets; above 20 is a long exact repeat


def _request_index_config() -> IndexConfig:
    # A prompt is short and copied from closely: bigrams anchor, a generation never evicts.
    return IndexConfig(anchor_orders=(2, 6), min_match=2, max_candidates=32,
                       max_tokens=1 << 22, wraps_live_end=True)


@dataclass(frozen=True)
class MemoryConfig:
    request_index: IndexConfig = field(default_factory=_request_index_config)
    memory_index: IndexConfig = field(default_factory=IndexConfig)  # when none is given
    max_depth: int = 32  # deepest node proposed (a long exact repeat drafts far ahead)
    max_nodes: int = 48  # nodes per source before the merge
    nodes_per_match: float = 2.0  # a match of m tokens proposes at most this x m nodes
    min_score: float = 0.05  # conditional-frequency product below which nothing is proposed
    prior_ratio: float = 0.5  # acceptance / frequency assumed before any evidence
    # Past the first levels a continuation whose start held usually goes on as it did
    # before (SuffixDecoding trusts the frequencies there); the evidence corrects it.
    deep_prior_ratio: float = 0.85
    prior_weight: float = 3.0  # how many observations the prior is worth
    prompt_tail: int = 256  # prompt tokens kept with the answer (about the last user turn)
    min_insert: int = 8  # shorter generations are not worth remembering


class FrequencyCalibration(AcceptanceRates):
    """Acceptance relative to empirical frequency, by key: ``rate(key)`` is (hits + prior
    x weight) / (summed frequency of the proposals + weight), so ``frequency x rate`` is
    a calibrated P(accepted | parent accepted). Levels past ``_LOCAL_DEPTH`` start from
    ``deep_prior``."""

    def __init__(self, prior_rate: float, deep_prior: float, prior_weight: float) -> None:
        super().__init__(prior_rate, prior_weight)
        self.deep_prior = deep_prior
        self._rates: dict[RateKey, float] = {}  # until the next observation

    def rate(self, key: RateKey) -> float:  # type: ignore[override]
        known = self._rates.get(key)
        if known is None:
            known = self._rates[key] = super().rate(key)
        return known

    def prior_for(self, key: RateKey) -> float:  # type: ignore[override]
        where, match, depth = key
        if depth < _LOCAL_DEPTH:
            return self.prior_rate
        if depth == _LOCAL_DEPTH:
            return self.deep_prior
        # A level is verified only once every level above it held, so the deepest
        # levels get no evidence while the budget stops short of them. Until they have
        # their own, a continuation goes on as reliably as one depth bucket up did for
        # the same kind of match: a model looping goes on (drafts grow to the
        # budget's limit), a summary's copy that drifts stays short.
        return self.rate((where, match, depth - 1))

    def observe(self, key: RateKey, accepted: bool, frequency: float) -> None:
        counts = self.counts[key]
        counts[0] += accepted
        counts[1] += frequency
        self._rates.clear()


@dataclass
class _Proposal:
    score: float  # calibrated path probability, the best over the sources proposing it
    q_base: float  # conditional probability before the local factor (what local learns)
    keys: list[tuple[RateKey, float]]  # (calibration key, frequency) per proposing source
    from_memory: bool


def _bucket(value: int, tops: tuple[int, ...]) -> int:
    for bucket, top in enumerate(tops):
        if value <= top:
            return bucket
    return len(tops)


class MemoryDrafter(Drafter):
    """Drafts from the generation's own text and from ``memory`` (shared, the caller's to
    save). ``draft`` depends only on the tokens seen (this generation's and the ones in
    memory), siblings carry distinct tokens and scores never grow along a path."""

    name = kind = DrafterKind.MEMORY

    def __init__(self, memory: SuffixIndex | None = None,
                 config: MemoryConfig | None = None) -> None:
        self.config = config or MemoryConfig()
        self.memory = memory if memory is not None else SuffixIndex(self.config.memory_index)
        self.rates = FrequencyCalibration(self.config.prior_ratio,
                                          self.config.deep_prior_ratio,
                                          self.config.prior_weight)
        self.local = LocalCalibration()
        self.request: SuffixIndex | None = None  # None outside a generation
        self.context: list[int] = []
        self._n_prompt = 0
        self._pending: dict[tuple[int, ...], _Proposal] = {}  # the last draft, by path
        self._memory_positions: list[int] = []  # where the last memory draft came from
        self.n_drafts = 0
        self.n_empty = 0
        self.n_memory_nodes = 0  # proposed nodes the memory backed

    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        self.context = list(context)
        self._n_prompt = max(0, len(context) - 1)  # the last one is the first answer token
        self.request = SuffixIndex(self.config.request_index)
        self.request.insert(self.context)
        self._pending = {}
        self.local.reset()

    def draft(self, max_tokens: int, token_time_s: float = 0.0) -> DraftTree:
        """Up to ``max_tokens`` nodes, scored with calibrated acceptance probabilities;
        empty outside a generation or without a match."""
        self._pending = {}
        if self.request is None:
            return DraftTree()
        proposals: dict[tuple[int, ...], _Proposal] = {}
        if max_tokens > 0:
            cfg = self.config
            n_tail = max(self.request.config.max_match, self.memory.config.max_match)
            tail = self.context[-n_tail:]
            for source, index in ((REQUEST, self.request), (MEMORY, self.memory)):
                spec = index.continuations(tail, cfg.max_depth, min(cfg.max_nodes, max_tokens),
                                           nodes_per_match=cfg.nodes_per_match,
                                           min_score=cfg.min_score)
                self._calibrate(spec, source, proposals)
                if source == MEMORY:
                    self._memory_positions = spec.positions
        tree = self._select(proposals, max_tokens)
        self.n_drafts += 1
        self.n_empty += not len(tree)
        self.n_memory_nodes += sum(p.from_memory for p in self._pending.values())
        return tree

    def _calibrate(self, spec: Speculation, source: int,
                   proposals: dict[tuple[int, ...], _Proposal]) -> None:
        """Add one source's nodes to ``proposals``, scored as calibrated path products.
        A path both sources propose keeps the higher score: since each source's scores
        fall along its paths, the maximum still never beats the parent's."""
        bucket = _bucket(spec.match_len, _MATCH_TOPS)
        if source == MEMORY:
            where = EARLIER
        else:  # the latest occurrence ends in this answer: the model repeats itself
            where = ANSWER if spec.positions and max(spec.positions) > self._n_prompt else PROMPT
        factor = self.local.factor
        paths: list[tuple[int, ...]] = []
        scores: list[float] = []
        tree = spec.tree
        for tok, parent, freq in zip(tree.tokens, tree.parents, spec.cond, strict=True):
            path = (*paths[parent], tok) if parent >= 0 else (tok,)
            depth_bucket = _bucket(len(path), _DEPTH_TOPS)
            key = (where, bucket, depth_bucket)
            q_base = min(1.0, freq * self.rates.rate(key))
            q = min(1.0, q_base * factor) if len(path) <= _LOCAL_DEPTH else q_base
            score = (scores[parent] if parent >= 0 else 1.0) * q
            paths.append(path)
            scores.append(score)
            known = proposals.get(path)
            if known is None:
                proposals[path] = _Proposal(score, q_base, [(key, freq)], source == MEMORY)
                continue
            known.keys.append((key, freq))
            known.from_memory |= source == MEMORY
            if score > known.score:
                known.score, known.q_base = score, q_base

    def _select(self, proposals: dict[tuple[int, ...], _Proposal],
                max_tokens: int) -> DraftTree:
        """The ``max_tokens`` best proposals as a tree. Sorting by (score desc, depth)
        puts every parent before its children, so the kept set is a tree."""
        ranked = sorted(proposals.items(), key=lambda kv: (-kv[1].score, len(kv[0])))
        tree = DraftTree()
        index: dict[tuple[int, ...], int] = {}
        for path, prop in ranked[:max_tokens]:
            parent = index.get(path[:-1], -1) if len(path) > 1 else -1
            if len(path) > 1 and parent < 0:
                continue  # unreachable (see above); never emit an orphan
            index[path] = tree.add(path[-1], parent, prop.score)
            self._pending[path] = prop
        return tree

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        """Learn from the last draft, then extend this generation's index. ``new_tokens``
        is the target's own path (accepted drafts, then its next token), so every
        proposed node whose parent lies on it is a success or a failure, whether the
        budget verified it or not."""
        target = tuple(new_tokens)
        memory_hit = False
        for path, prop in self._pending.items():
            depth = len(path)
            if depth > len(target) or target[:depth - 1] != path[:-1]:
                continue
            hit = target[depth - 1] == path[-1]
            self.local.update(prop.q_base, hit)
            for key, freq in prop.keys:
                self.rates.observe(key, hit, freq)
            memory_hit |= hit and prop.from_memory
        if memory_hit:
            self.memory.touch(self._memory_positions)  # useful memory is evicted last
        self._pending = {}
        self.context.extend(new_tokens)
        if self.request is not None:
            self.request.extend(new_tokens)

    def finish(self, tokens: list[int]) -> None:
        """Remember the generation: ``tokens`` are its prompt and answer. The answer is
        kept with the last ``prompt_tail`` prompt tokens (about the last user turn, which
        is what a later request repeats); the older prompt is usually in memory already.
        Ends the generation: ``draft`` proposes nothing until the next ``begin``."""
        n_prompt = self._n_prompt
        if n_prompt and len(tokens) >= n_prompt and tokens[:n_prompt] == self.context[:n_prompt]:
            tokens = tokens[max(0, n_prompt - self.config.prompt_tail):]
        if len(tokens) >= self.config.min_insert:
            self.memory.insert(tokens)
        self.request = None
        self._pending = {}

    def stats(self) -> dict[str, float]:
        return {"drafts": self.n_drafts, "empty_drafts": self.n_empty,
                "memory_nodes": self.n_memory_nodes,
                "memory_entries": self.memory.n_entries,
                "memory_sequences": self.memory.n_sequences,
                "memory_bytes": self.memory.nbytes()}
