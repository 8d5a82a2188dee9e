"""A bounded index of token sequences: what followed the current context's suffix before.

SuffixDecoding (arXiv 2411.04975) drafts from a suffix tree over earlier text: find the
longest suffix of the context seen before and propose the continuations that followed
it, each node scored by its empirical conditional frequency (a path product). This
module answers that question for two scopes: one generation's prompt and answer, and a
per-model memory of everything the model wrote before (saved to disk).

Structure: the sequences sit in one flat ``array('i')`` separated by -1, and each anchor
order n (e.g. 3 and 8) has an LZ77-style hash chain, ``head[hash(n-gram) & mask]`` = the
latest position ending that n-gram and ``prev[pos]`` = the one before it. A lookup walks
the chain of the context's last n tokens (longest anchor first), extends each occurrence
backwards to its true match length (which also filters hash collisions), keeps the
occurrences with the longest match and grows the continuation tree best-first from the
tokens that followed them. Compared with a suffix trie of depth D this costs 4 bytes per
token per anchor order instead of D trie nodes of Python objects, inserts in O(len x
orders), and the continuations are read straight from the stored text. The bound counts
stored positions; past it, whole sequences are evicted least recently used first (a
sequence is used when inserted or when a draft from it was accepted).
"""

from __future__ import annotations

import heapq
import json
import os
import struct
import sys
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

from engine.errors import TandemError
from engine.runtime.draft_tree import DraftTree

SEPARATOR = -1  # between sequences: no match or continuation crosses it
_TYPECODE = next(code for code in "ilq" if array(code).itemsize == 4)
MAGIC = b"TNDMSUFX"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQI")  # magic, format version, payload bytes, CRC-32 of payload
_META_LEN = struct.Struct("<I")
_SEQ_BYTES = 80  # bookkeeping per sequence: two list slots and two int objects
_FIXED_BYTES = 2048  # the object, its lists and arrays when empty


class MemoryFileError(TandemError, ValueError):
    """A memory file that cannot be used: truncated, corrupt, another format version, or
    made for another model."""


@dataclass(frozen=True)
class IndexConfig:
    """Defaults suit the per-model memory; a generation's own index uses lower anchors."""

    anchor_orders: tuple[int, ...] = (3, 8)  # n-gram lengths with a hash chain
    min_match: int = 3  # a shorter matched suffix proposes nothing
    max_match: int = 32  # suffix length compared (longer matches count as this)
    max_candidates: int = 32  # most recent occurrences of the anchor looked at
    max_chain_steps: int = 256  # chain links followed per anchor (collisions included)
    nodes_per_match: float = 2.0  # a match of m tokens proposes at most this x m nodes
    min_score: float = 0.05  # frequency product below which a node is not proposed
    max_tokens: int = 1 << 18  # bound on stored positions (tokens and separators)
    max_bytes: int | None = None  # optional bound on the estimated bytes
    evict_to: float = 0.75  # eviction keeps this share of the bound (hysteresis)
    min_buckets: int = 1 << 10
    # The last sequence is live text that goes on: a continuation that runs into its end
    # goes on copying itself (LZ77's overlapping copy), so a text that repeats with a
    # short period (a model looping, a list pattern) drafts far ahead.
    wraps_live_end: bool = False

    def __post_init__(self) -> None:
        if not self.anchor_orders or min(self.anchor_orders) < 1:
            raise ValueError("anchor_orders needs at least one order >= 1")
        if not 1 <= self.min_match <= self.max_match or max(self.anchor_orders) > self.max_match:
            raise ValueError("need 1 <= min_match <= max_match and anchors <= max_match")
        if self.max_tokens < 1 or not 0 < self.evict_to <= 1:
            raise ValueError("max_tokens must be positive and 0 < evict_to <= 1")


@dataclass
class Speculation:
    """Continuations of one lookup. ``tree.scores`` are conditional-frequency products;
    ``cond[i]`` is node i's frequency given its parent; ``positions`` are where the
    matched occurrences continue (for ``SuffixIndex.touch``)."""

    tree: DraftTree = field(default_factory=DraftTree)
    cond: list[float] = field(default_factory=list)
    match_len: int = 0  # longest suffix of the context found (0: none)
    positions: list[int] = field(default_factory=list)


def _checked(tokens: Sequence[int]) -> list[int]:
    tokens = list(tokens)
    if tokens and (min(tokens) < 0 or max(tokens) >= 1 << 31):
        raise ValueError("token ids must lie in 0..2**31-1")
    return tokens


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _spans(starts: list[int], n_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each stored sequence: a separator token sits between two."""
    ends = [s - 1 for s in starts[1:]] + [n_tokens] if starts else []
    return list(zip(starts, ends, strict=True))


class SuffixIndex:
    """Token sequences with hash chains over their anchor n-grams, bounded in size.

    Everything it returns is a function of the sequences inserted (and of the order of
    inserts and touches, for eviction), never of randomness: drafts built on it keep
    speculative sampling exact. Not thread-safe.
    """

    def __init__(self, config: IndexConfig | None = None, tag: str = "") -> None:
        self.config = config or IndexConfig()
        self.tag = tag  # who the tokens belong to (a model fingerprint), saved with them
        self._orders = tuple(sorted(set(self.config.anchor_orders)))
        self._tokens = array(_TYPECODE)
        self._starts: list[int] = []  # first position of each sequence
        self._last_used: list[int] = []  # logical clock of each sequence's last use
        self._clock = 0
        self.n_evictions = 0
        self._reset_tables(self.config.min_buckets)

    # -- size -------------------------------------------------------------------------

    @property
    def n_entries(self) -> int:
        """Stored positions (tokens and separators): what ``max_tokens`` bounds."""
        return len(self._tokens)

    @property
    def n_sequences(self) -> int:
        return len(self._starts)

    def nbytes(self) -> int:
        """Approximate memory held, in bytes (arrays as allocated, plus bookkeeping)."""
        arrays = [self._tokens, *self._prevs, *self._heads]
        return (_FIXED_BYTES + sum(sys.getsizeof(a) for a in arrays)
                + _SEQ_BYTES * len(self._starts))

    def _bytes_for(self, n_positions: int, n_sequences: int) -> int:
        """What ``nbytes`` will be after a rebuild to this size."""
        k = len(self._orders)
        return (_FIXED_BYTES + 4 * n_positions * (1 + k)
                + 4 * k * self._buckets_for(n_positions) + _SEQ_BYTES * n_sequences)

    def _buckets_for(self, n_positions: int) -> int:
        return _next_pow2(max(self.config.min_buckets, 2 * n_positions))  # load <= 1/2

    def _too_big(self) -> bool:
        cfg = self.config
        return (len(self._tokens) > cfg.max_tokens
                or (cfg.max_bytes is not None and self.nbytes() > cfg.max_bytes))

    def _over(self, n_positions: int, n_sequences: int, share: float = 1.0) -> bool:
        cfg = self.config
        if n_positions > cfg.max_tokens * share:
            return True
        return (cfg.max_bytes is not None
                and self._bytes_for(n_positions, n_sequences) > cfg.max_bytes * share)

    # -- inserting --------------------------------------------------------------------

    def insert(self, tokens: Sequence[int]) -> None:
        """Store ``tokens`` as a new sequence (no match runs across sequences). Raises
        ValueError for ids outside 0..2**31-1 (the index is left as it was)."""
        tokens = _checked(tokens)
        if not tokens:
            return
        self._clock += 1
        if self._tokens:
            self._tokens.append(SEPARATOR)
            for prev in self._prevs:
                prev.append(-1)
        self._starts.append(len(self._tokens))
        self._last_used.append(self._clock)
        self._append(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the last sequence (a generation's growing context)."""
        if not self._starts:
            self.insert(tokens)
        elif tokens := _checked(tokens):
            self._append(tokens)

    def _append(self, tokens: list[int]) -> None:
        a = len(self._tokens)
        self._tokens.extend(tokens)
        b = len(self._tokens)
        for prev in self._prevs:
            prev.extend(array(_TYPECODE, [-1]) * (b - a))
        if self._over(b, len(self._starts)) or self._too_big():  # after growth, or now
            self._evict()
        elif b > len(self._heads[0]):
            self._rebuild(self._sequences(), self._last_used)  # more buckets, same data
        else:
            self._index_range(a, b, self._starts[-1])

    def _reset_tables(self, n_buckets: int) -> None:
        n = len(self._tokens)
        self._mask = n_buckets - 1
        self._heads = [array(_TYPECODE, [-1]) * n_buckets for _ in self._orders]
        self._prevs = [array(_TYPECODE, [-1]) * n for _ in self._orders]

    def _index_range(self, a: int, b: int, start: int) -> None:
        """Chain the n-grams ending at positions a..b-1 of the sequence at ``start``."""
        lo = max(start, a - self._orders[-1] + 1)
        buf = self._tokens[lo:b].tolist()
        mask = self._mask
        for n, head, prev in zip(self._orders, self._heads, self._prevs, strict=True):
            first = max(a, start + n - 1)  # the first n-gram lying inside the sequence
            if first >= b:
                continue
            off = first - n + 1 - lo
            # zip of n shifted views: the n-grams ending at first, first + 1, ..., b - 1
            grams = zip(*(buf[off + j:] for j in range(n)), strict=False)  # lengths differ
            for pos, gram in enumerate(grams, first):
                h = hash(gram) & mask
                prev[pos] = head[h]
                head[h] = pos

    def _sequences(self) -> list[array]:
        return [self._tokens[s:e] for s, e in _spans(self._starts, len(self._tokens))]

    def _rebuild(self, sequences: list[array], last_used: list[int]) -> None:
        """Store exactly ``sequences`` and index them from scratch."""
        flat: list[int] = []
        starts: list[int] = []
        for seq in sequences:
            if flat:
                flat.append(SEPARATOR)
            starts.append(len(flat))
            flat.extend(seq)
        self._tokens = array(_TYPECODE, flat)
        self._starts = starts
        self._last_used = list(last_used)
        self._reset_tables(self._buckets_for(len(flat)))
        for s, e in _spans(starts, len(flat)):
            self._index_range(s, e, s)

    def _evict(self) -> None:
        """Drop least recently used sequences until the index is back under
        ``evict_to`` of its bounds; a lone sequence that is still too long keeps its
        most recent tokens."""
        seqs = self._sequences()
        alive = [True] * len(seqs)
        n_pos, n_seq = len(self._tokens), len(seqs)
        share = self.config.evict_to
        for i in sorted(range(len(seqs)), key=lambda i: (self._last_used[i], i)):
            if n_seq == 1 or not self._over(n_pos, n_seq, share):
                break
            alive[i] = False
            n_pos -= len(seqs[i]) + 1
            n_seq -= 1
            self.n_evictions += 1
        kept = [i for i in range(len(seqs)) if alive[i]]
        if n_seq == 1 and self._over(len(seqs[kept[0]]), 1, share):
            seqs[kept[0]] = seqs[kept[0]][-self._fitting_length(share):]
        self._rebuild([seqs[i] for i in kept], [self._last_used[i] for i in kept])

    def _fitting_length(self, share: float) -> int:
        """The longest single sequence within ``share`` of the bounds."""
        lo, hi = 1, int(self.config.max_tokens * share)
        while lo < hi:  # binary search: the byte bound has no closed form (bucket rounding)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if not self._over(mid, 1, share) else (lo, mid - 1)
        return lo

    # -- looking up -------------------------------------------------------------------

    def continuations(self, context_tail: Sequence[int], max_depth: int, max_nodes: int, *,
                      nodes_per_match: float | None = None,
                      min_score: float | None = None) -> Speculation:
        """What followed the longest suffix of ``context_tail`` seen before, as a tree.

        Contract: parents come before children, siblings carry distinct tokens, each
        node's score is the product of conditional frequencies on its path (in (0, 1],
        never above its parent's), and the tree was grown best-first by score. Its size
        is at most ``max_nodes`` and ``nodes_per_match`` x the match length; matches
        shorter than ``min_match`` propose nothing.
        """
        cfg = self.config
        tail = list(context_tail[-cfg.max_match:])
        match_len, starts = self._longest_match(tail)
        if match_len < cfg.min_match:
            return Speculation(match_len=match_len)
        per_match = cfg.nodes_per_match if nodes_per_match is None else nodes_per_match
        cap = min(max_nodes, int(per_match * match_len))
        floor = cfg.min_score if min_score is None else min_score
        tree, cond = self._grow(starts, max_depth, cap, floor)
        return Speculation(tree, cond, match_len, starts)

    def _longest_match(self, tail: list[int]) -> tuple[int, list[int]]:
        """(longest match length, positions after each occurrence matching that long),
        looking at the most recent occurrences of the longest anchor that has any."""
        cfg = self.config
        toks, n_tok, n_tail = self._tokens, len(self._tokens), len(tail)
        for n, head, prev in reversed(list(zip(self._orders, self._heads, self._prevs,
                                               strict=True))):
            if n > n_tail:
                continue
            found: list[tuple[int, int]] = []
            pos = head[hash(tuple(tail[-n:])) & self._mask]
            n_steps = 0
            while pos >= 0 and n_steps < cfg.max_chain_steps and len(found) < cfg.max_candidates:
                n_steps += 1
                if pos + 1 < n_tok and toks[pos + 1] >= 0:  # something followed it
                    k = 0  # match length, counted backwards; separators never match
                    while k < n_tail and k <= pos and toks[pos - k] == tail[-1 - k]:
                        k += 1
                    if k >= n:  # shorter: a hash collision
                        found.append((k, pos + 1))
                pos = prev[pos]
            if found:
                best = max(k for k, _ in found)
                return best, [p for k, p in found if k == best]
        return 0, []

    def _grow(self, starts: list[int], max_depth: int, max_nodes: int,
              min_score: float) -> tuple[DraftTree, list[float]]:
        """Best-first tree over the continuations at ``starts`` (SuffixDecoding's
        frequency scoring): a child's score is its parent's times the share of the
        parent's continuing occurrences that go on with the child's token."""
        toks, n_tok = self._tokens, len(self._tokens)
        wraps = self.config.wraps_live_end
        tree, cond = DraftTree(), []
        heap: list[tuple[float, int, int, int, list[tuple[int, int]], int, float]] = []
        n_pushed = 0

        def push_children(node: int, positions: list[tuple[int, int]], score: float,
                          depth: int) -> None:
            # positions: (where the next token is read, where this continuation began)
            nonlocal n_pushed
            groups: dict[int, list[tuple[int, int]]] = {}
            for p, start in positions:
                if p >= n_tok and wraps and p > start:
                    p = start  # the text after the live end repeats from the start
                if p < n_tok and (tok := toks[p]) >= 0:
                    groups.setdefault(tok, []).append((p + 1, start))
            n_total = sum(len(g) for g in groups.values())
            for tok, nxt in groups.items():  # most recent first: ties go to recency
                freq = len(nxt) / n_total
                if score * freq >= min_score:
                    n_pushed += 1
                    heapq.heappush(heap, (-score * freq, n_pushed, node, tok, nxt, depth, freq))

        push_children(-1, [(s, s) for s in starts], 1.0, 1)
        while heap and len(tree) < max_nodes:
            neg_score, _, parent, tok, nxt, depth, freq = heapq.heappop(heap)
            node = tree.add(tok, parent, -neg_score)
            cond.append(freq)
            if depth < max_depth:
                push_children(node, nxt, -neg_score, depth + 1)
        return tree, cond

    def touch(self, positions: Sequence[int]) -> None:
        """Mark the sequences holding ``positions`` as just used (eviction goes LRU)."""
        self._clock += 1
        for p in positions:
            if 0 <= p < len(self._tokens):
                self._last_used[bisect_right(self._starts, p) - 1] = self._clock

    # -- persistence ------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the sequences atomically (temp file, fsync, rename) in a versioned,
        CRC-checked binary format; the hash chains are rebuilt on load. Raises OSError."""
        path = Path(path)
        meta = {"tag": self.tag, "clock": self._clock, "last_used": self._last_used,
                "lengths": [e - s for s, e in _spans(self._starts, len(self._tokens))]}
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        tokens = array(_TYPECODE, self._tokens)
        if sys.byteorder == "big":
            tokens.byteswap()  # the file is little-endian
        payload = _META_LEN.pack(len(meta_bytes)) + meta_bytes + tokens.tobytes()
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path, config: IndexConfig | None = None,
             tag: str | None = None) -> SuffixIndex:
        """The index saved at ``path``; an empty one when there is no file. With ``tag``,
        the file must have been saved with the same tag. Raises MemoryFileError for a
        truncated, corrupt, foreign-version or other-tag file, OSError when unreadable.
        A ``config`` with a smaller bound evicts on load."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(config, tag or "")
        meta, tokens = _parse(data)
        if tag is not None and meta["tag"] != tag:
            raise MemoryFileError(f"saved for {meta['tag']!r}, not {tag!r}")
        index = cls(config, meta["tag"])
        seqs, pos = [], 0
        for n in meta["lengths"]:
            seqs.append(tokens[pos:pos + n])
            pos += n + 1
        index._clock = meta["clock"]
        index._rebuild(seqs, meta["last_used"])
        if index._too_big():
            index._evict()
        return index


def _parse(data: bytes) -> tuple[dict, array]:
    """Check and split a memory file's bytes. Raises MemoryFileError."""
    if len(data) < _HEADER.size:
        raise MemoryFileError("truncated header")
    magic, version, n_payload, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MemoryFileError("not a Tandem memory file")
    if version != FORMAT_VERSION:
        raise MemoryFileError(f"format version {version}, this build reads {FORMAT_VERSION}")
    payload = data[_HEADER.size:]
    if len(payload) != n_payload:
        raise MemoryFileError(f"truncated: {len(payload)} of {n_payload} payload bytes")
    if zlib.crc32(payload) != crc:
        raise MemoryFileError("checksum mismatch")
    try:
        (n_meta,) = _META_LEN.unpack_from(payload)
        meta = json.loads(payload[_META_LEN.size:_META_LEN.size + n_meta])
        tokens = array(_TYPECODE)
        tokens.frombytes(payload[_META_LEN.size + n_meta:])
        if sys.byteorder == "big":
            tokens.byteswap()
        lengths, last_used = meta["lengths"], meta["last_used"]
        ok = (isinstance(meta["tag"], str) and isinstance(meta["clock"], int)
              and len(lengths) == len(last_used)
              and all(isinstance(n, int) and n > 0 for n in lengths)
              and all(isinstance(t, int) for t in last_used)
              and sum(lengths) + max(0, len(lengths) - 1) == len(tokens)
              and tokens.count(SEPARATOR) == max(0, len(lengths) - 1)
              and (not tokens or min(tokens) >= SEPARATOR)
              and _separators_in_place(tokens, lengths))
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise MemoryFileError(f"unreadable contents ({e})") from e
    if not ok:
        raise MemoryFileError("inconsistent contents")
    return meta, tokens


def _separators_in_place(tokens: array, lengths: list[int]) -> bool:
    ends = accumulate(n + 1 for n in lengths[:-1])  # each sequence's separator, plus one
    return all(tokens[e - 1] == SEPARATOR for e in ends)


def open_memory(path: str | Path, config: IndexConfig | None = None,
                tag: str | None = None) -> tuple[SuffixIndex, str]:
    """The memory saved at ``path`` and a note for the user: empty when all went well
    (or there was no file yet); for an unusable file, an empty index and a note naming
    the file, which the next ``save`` replaces. Never raises for a bad file."""
    try:
        return SuffixIndex.load(path, config, tag), ""
    except (MemoryFileError, OSError) as e:
        note = f"draft memory {path} could not be used ({e}); starting with an empty memory"
        return SuffixIndex(config, tag or ""), note
