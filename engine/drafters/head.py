"""The EAGLE-style draft head as a drafter: chain or EAGLE-2 dynamic tree.

The head keeps its own KV cache in step with the conversation: entry j pairs the
target's true feature of token j with token j+1, at position j. After each verification
the target's features of the accepted tokens replace the head's guesses (``accept``),
and the head's output for the last entry is the predicted feature from which the next
draft starts. Draft-time entries (built from predicted features) live only for one
``draft`` call.

Tree drafting (EAGLE-2): expand the ``top_k`` best nodes of the newest level ``depth``
times; a node's score is the product of draft probabilities along its path; keep the
best nodes (their scores go to the budget as acceptance estimates, scaled online by
how this drafter's guesses fared at each depth).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from engine.drafters.base import Drafter
from engine.drafters.head_fit import EAGLE1_UNCHECKED, check_head_fits
from engine.drafters.kinds import DrafterKind
from engine.runtime.draft_tree import DraftTree
from engine.runtime.sequences import common_prefix_length
from models.draft_head import DraftHead, KVBuffer
from models.eagle1_config import is_eagle1_dir
from models.gguf_weights import TargetForHead, target_for_head
from models.head_config import TargetFingerprint
from models.int8_linear import int8_available

# Drafts served ahead in a row before an ordinary draft brings the head's cache up to
# date with the target's true features (drafts ahead build on predicted ones).
MAX_AHEAD_RUN = 4


@dataclass(frozen=True)
class HeadDrafterConfig:
    # "tree" (EAGLE-2), "chain", or "multi" (DuoDecoding: a chain plus the other first
    # tokens likelier than the chain's second node)
    mode: str = "tree"
    top_k: int = 4  # children per expanded node, and nodes expanded per level
    depth: int = 5  # levels drafted
    n_threads: int = 1  # torch threads on a CPU (tiny matmuls gain nothing from more)
    # Prompt tokens whose features the head reads: each costs the target an LM-head row
    # in the prefill (time to first token); the head mostly attends to recent tokens.
    prompt_features: int | None = 8
    dynamic_depth: bool = True  # stop a draft early when the next level cannot pay
    # DuoDecoding's overlap: while the target verifies a draft, continue its likeliest
    # path (assuming the target takes all of it) so the next step's draft is ready.
    draft_ahead: bool = False
    # On a CPU: "int8" weights read a quarter of float32's bytes per level (faster, and
    # mostly the float head's top-1; docs/benchmarks.md: figures behind the code's
    # rules, "Per-step costs"), or "float".
    weights: str = "int8"

    def __post_init__(self) -> None:
        if self.mode not in ("tree", "chain", "multi"):
            raise ValueError(f"mode must be 'tree', 'chain' or 'multi', got {self.mode!r}")
        if self.weights not in ("int8", "float"):
            raise ValueError(f"weights must be 'int8' or 'float', got {self.weights!r}")
        if self.top_k < 1 or self.depth < 1:
            raise ValueError("top_k and depth must be >= 1")


@dataclass
class _Node:
    token: int  # target id
    parent: int  # node index, -1 for children of the root
    score: float  # path probability under the draft
    depth: int
    entry: int = -1  # index among draft-time cache entries once expanded


@dataclass
class _DraftWork:
    """Draft-time state: the nodes and the head cache entries built from predicted
    features, kept while drafts ahead go on extending them."""

    n: int  # position of the first draft entry
    nodes: list[_Node] = field(default_factory=list)
    # Expanded nodes in the order of their entries, which follow the committed ones in
    # the head's cache buffers.
    entry_nodes: list[int] = field(default_factory=list)


@dataclass
class _Ahead:
    """A draft made during the last verification, for when the target's new tokens are
    ``expected``."""

    expected: list[int]
    tree: DraftTree
    node_ids: list[int]
    raw_scores: list[float]


class DepthCalibration:
    """Observed acceptance over predicted, per depth (exponentially forgotten), so node
    scores given to the budget track how the head really fares here."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.hit: dict[int, float] = {}
        self.expected: dict[int, float] = {}

    def factor(self, depth: int) -> float:
        e = self.expected.get(depth, 0.0)
        if e < 1.0:
            return 1.0
        return min(1.5, max(0.2, self.hit.get(depth, 0.0) / e))

    def observe(self, depth: int, predicted: float, accepted: bool) -> None:
        for table, value in ((self.hit, float(accepted)), (self.expected, predicted)):
            table[depth] = self.decay * table.get(depth, 0.0) + value


class HeadDrafter(Drafter):
    name = kind = DrafterKind.HEAD
    needs_features = True
    is_draft_model = True

    def __init__(self, head: DraftHead, config: HeadDrafterConfig | None = None) -> None:
        self.head = head.eval()
        self.config = config or HeadDrafterConfig()
        self.device = head.lm_head.device
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.n_threads)
        self.calibration = DepthCalibration()
        self.load_notes: list[str] = []  # what the user should know about this head
        self._tokens: list[int] = []  # the context, last token included
        self._feats = np.zeros((0, head.cfg.hidden_size), np.float32)  # true features
        self._base = 0  # position of the first cache entry
        # Entries from the conversation (committed), then the current draft's.
        self._cache: list[KVBuffer] = head.new_cache()
        self._committed = 0
        self._root_hidden: torch.Tensor | None = None  # predicted feature of the last token
        self._last_draft: DraftTree | None = None
        self._raw_scores: list[float] = []
        self._entry_hidden = torch.zeros(0)  # predicted features of draft-time entries
        self._t_head_s = 0.0
        self._n_head_calls = 0
        self.prompt_features = self.config.prompt_features
        self._level_s = 0.0  # measured time of one drafting level (moving average)
        # Accepted tokens not yet run through the head: (first position, features,
        # tokens). Extended lazily at the next draft, in one batch, so steps where the
        # engine does not draft cost the head nothing.
        self._pending: list[tuple[int, np.ndarray, list[int]]] = []
        # Draft ahead (DuoDecoding overlap): the last draft's working state, the node
        # ids of the tree served (``_last_draft``), the draft made during verification
        # and, once the target's tokens matched it, the one ready to serve.
        self._work: _DraftWork | None = None
        self._served_nodes: list[int] = []
        self._ahead: _Ahead | None = None
        self._ready: _Ahead | None = None
        self.drafts_ahead = self.config.draft_ahead
        self._ahead_run = 0  # drafts served ahead since the last ordinary draft

    # --- the head's committed cache --------------------------------------------------
    @property
    def _n_entries(self) -> int:
        return self._committed

    def _trim_cache(self, end: int) -> None:
        """Keep entries at positions < ``end``."""
        self._committed = min(self._committed, max(0, end - self._base))
        self._drop_draft_entries()

    def _drop_draft_entries(self) -> None:
        for buffer in self._cache:
            buffer.truncate(self._committed)

    @torch.no_grad()
    def _extend(self, first: int, feats: np.ndarray, next_tokens: list[int]) -> None:
        """Append entries (feature j, token j+1) at positions first..; the last output
        becomes the root prediction."""
        t0 = time.perf_counter()
        f = torch.from_numpy(np.ascontiguousarray(feats, np.float32)).to(self.device)
        tok = torch.tensor(next_tokens, device=self.device)
        pos = torch.arange(first, first + len(next_tokens), device=self.device)
        self._drop_draft_entries()
        out, _ = self.head(f[None], tok[None], pos[None], self._cache)
        self._committed += len(next_tokens)
        self._root_hidden = out[0, -1]
        self._t_head_s += time.perf_counter() - t0
        self._n_head_calls += 1

    # --- Drafter ---------------------------------------------------------------------
    def begin(self, context: list[int], features: np.ndarray | None) -> None:
        if features is None:
            raise ValueError("the head drafter needs the target's features")
        prompt_len = len(context) - 1
        start = prompt_len - len(features)  # prompt tokens the target reused from its cache
        shared = common_prefix_length(self._tokens, context)
        if start <= min(shared, len(self._feats)) and self._base == 0:
            # The reused prefix is one we saw: keep its features and cache entries.
            feats = np.concatenate([self._feats[:start], features])
            keep = max(0, min(self._base + self._n_entries, shared - 1, start))
            self._trim_cache(keep)
            first = keep
        else:
            # Nothing to rebuild the reused prefix from: attend to the new part only.
            feats = np.asarray(features, np.float32)
            self._base, first = start, start
            self._trim_cache(start)  # no entries
            self._feats = np.zeros((start, feats.shape[1]), np.float32)
            feats = np.concatenate([self._feats, feats])
        self._tokens = list(context)
        self._feats = np.asarray(feats, np.float32)
        self._pending = [(first, self._feats[first:prompt_len], context[first + 1:])]
        self._root_hidden = None
        self._last_draft = None
        self._work = self._ahead = self._ready = None

    def _flush(self) -> None:
        """Run the head over the accepted tokens it has not seen yet."""
        if not self._pending:
            return
        first = self._pending[0][0]
        feats = np.concatenate([f for _, f, _ in self._pending])
        tokens = [t for _, _, toks in self._pending for t in toks]
        self._pending = []
        if tokens:
            self._extend(first, feats, tokens)

    def accept(self, new_tokens: list[int], features: np.ndarray | None) -> None:
        if features is None:
            raise ValueError("the head drafter needs the target's features")
        self._learn(new_tokens)
        ahead, self._ahead, self._ready = self._ahead, None, None
        if ahead is not None and list(new_tokens) == ahead.expected and (
                self._ahead_run < MAX_AHEAD_RUN):
            self._ready = ahead
        n = len(self._tokens) - 1  # position of the token whose feature arrives first
        features = np.asarray(features, np.float32)
        self._tokens.extend(new_tokens)
        self._feats = np.concatenate([self._feats, features])
        self._pending.append((n, features, list(new_tokens)))

    def _learn(self, new_tokens: list[int]) -> None:
        """Calibrate node scores on which of the last draft's nodes the target took."""
        tree = self._last_draft
        if tree is None or not tree.scores:
            return
        accepted_path: list[int] = []
        parent = -1
        for tok in new_tokens:
            child = tree.child_with_token(parent, tok)
            if child is None:
                break
            accepted_path.append(child)
            parent = child
        on_path = set(accepted_path)
        depths = tree.depths()
        for i, p in enumerate(tree.parents):
            # Judge every node whose parent the target's tokens reached (trimmed ones
            # too: the target's path says whether they would have been accepted).
            if depths[i] <= len(new_tokens) and (p == -1 or p in on_path):
                self.calibration.observe(depths[i], self._raw_scores[i], i in on_path)
        self._last_draft = None

    @torch.no_grad()
    def draft(self, max_tokens: int, token_time_s: float) -> DraftTree:
        if max_tokens <= 0:
            return DraftTree()
        if self._ready is not None:
            return self._serve_ahead(max_tokens)
        self._flush()
        self._work = None
        self._drop_draft_entries()
        self._ahead_run = 0
        if self._root_hidden is None:
            return DraftTree()
        t0 = time.perf_counter()
        cfg = self.config
        width = cfg.top_k if cfg.mode == "tree" else 1
        work = _DraftWork(n=len(self._tokens) - 1)
        nodes = work.nodes
        level = self._children(self._root_hidden[None], [-1], [1.0],
                               1 if cfg.mode == "chain" else cfg.top_k, depth=1, nodes=nodes)
        alternatives: list[int] = []
        if cfg.mode == "multi":  # one chain from the best first token; the rest wait
            alternatives, level = level[1:], level[:1]
        for depth in range(2, cfg.depth + 1):
            if len(nodes) >= 4 * max_tokens:
                break
            expand = sorted(level, key=lambda i: -nodes[i].score)[:width]
            # Dynamic depth: stop when even the likeliest next token could not repay the
            # time a level of drafting takes (in target-token time it would save).
            if not self._level_pays(nodes[expand[0]].score, depth, token_time_s):
                break
            t_level = time.perf_counter()
            hidden = self._expand(expand, work)
            level = self._children(hidden, expand, [nodes[i].score for i in expand], width,
                                   depth=depth, nodes=nodes)
            took = time.perf_counter() - t_level
            self._level_s = took if self._level_s == 0 else 0.8 * self._level_s + 0.2 * took
        if alternatives:
            # DuoDecoding's multi-sequence rule: another first token is worth a sequence
            # when it beats theta = p(1,1) * p(2,1), the chain's second node.
            theta = max((nd.score for nd in nodes if nd.depth == 2), default=0.0)
            for i in alternatives:
                if nodes[i].score <= theta:
                    nodes[i].score = -1.0  # not drafted
        tree = self._select(nodes, max_tokens)
        self._work = work
        self._t_head_s += time.perf_counter() - t0
        self._n_head_calls += 1
        return tree

    def _level_pays(self, score: float, depth: int, token_time_s: float) -> bool:
        """Whether a node this likely is worth a level of drafting (dynamic depth): the
        target-token time it would save against the time a level takes."""
        best = score * self.calibration.factor(depth)
        return not (self.config.dynamic_depth and self._level_s > 0
                    and best * token_time_s < self._level_s)

    def _serve_ahead(self, max_tokens: int) -> DraftTree:
        """The draft made during the last verification; the head's cache catches up
        with the accepted tokens at the next ordinary draft."""
        ahead, self._ready = self._ready, None
        tree = ahead.tree.truncated(max_tokens)
        tree.made_ahead = True
        self._last_draft, self._raw_scores = tree, ahead.raw_scores[:len(tree)]
        self._served_nodes = ahead.node_ids[:len(tree)]
        self._ahead_run += 1
        return tree

    @torch.no_grad()
    def draft_ahead(self, verifying: DraftTree, max_tokens: int, token_time_s: float) -> None:
        """Run while the target verifies ``verifying`` (the last draft, maybe trimmed):
        extend its likeliest full path by the head's guess of the target's next token
        and a chain after it. Used by the next ``draft`` only if the target's new tokens
        are exactly that path and guess."""
        self._ahead = None
        work, served = self._work, self._last_draft
        if work is None or served is None or not verifying.tokens or max_tokens <= 0:
            return
        expected, cur = self._likeliest_path(verifying, served, self._served_nodes)
        if cur < 0:
            return
        chain: list[int] = []
        for level in range(max_tokens + 1):
            node = work.nodes[cur]
            if level >= 2 and not self._level_pays(node.score, level, token_time_s):
                break
            if node.entry < 0:
                self._expand([cur], work)
            hidden = self._entry_hidden[work.nodes[cur].entry]
            (cur,) = self._children(hidden[None], [cur], [node.score], 1,
                                    depth=node.depth + 1, nodes=work.nodes)
            if level == 0:  # the guess of the target's own token: scores start after it
                expected.append(work.nodes[cur].token)
                work.nodes[cur].score = 1.0
            else:
                chain.append(cur)
        if not chain:
            return
        tree = DraftTree()
        for j, i in enumerate(chain, start=1):
            tree.add(work.nodes[i].token, j - 2,
                     min(1.0, work.nodes[i].score * self.calibration.factor(j)))
        self._ahead = _Ahead(expected, tree, chain, [work.nodes[i].score for i in chain])

    @staticmethod
    def _likeliest_path(verifying: DraftTree, served: DraftTree, node_ids: list[int]
                        ) -> tuple[list[int], int]:
        """Tokens of ``verifying``'s path of best-scored children, and the node id of its
        end (-1 when the tree is not part of the served one)."""
        children = verifying.children()  # verification numbering: node i is i + 1
        tokens: list[int] = []
        v_parent = s_parent = -1
        node = -1
        while children[v_parent + 1]:
            best = max(children[v_parent + 1],
                       key=lambda k: verifying.scores[k - 1] if verifying.scores else 0.0) - 1
            s = served.child_with_token(s_parent, verifying.tokens[best])
            if s is None:
                return tokens, -1
            tokens.append(verifying.tokens[best])
            node, v_parent, s_parent = node_ids[s], best, s
        return tokens, node

    def _children(self, hidden: torch.Tensor, parents: list[int], parent_scores: list[float],
                  width: int, depth: int, nodes: list[_Node]) -> list[int]:
        """Add the ``width`` most likely tokens after each predicted feature."""
        probs = torch.softmax(self.head.logits(hidden).float(), dim=-1)
        top_p, top_i = probs.topk(width, dim=-1)
        top_t = self.head.d2t[top_i].tolist()
        out = []
        for r, parent in enumerate(parents):
            for p, t in zip(top_p[r].tolist(), top_t[r], strict=True):
                nodes.append(_Node(t, parent, parent_scores[r] * p, depth))
                out.append(len(nodes) - 1)
        return out

    def _expand(self, expand: list[int], work: _DraftWork) -> torch.Tensor:
        """Run the head on the chosen nodes (one batch, tree mask); their predicted
        features. Their entries join the draft-time cache."""
        dev = self.device
        nodes, entry_nodes = work.nodes, work.entry_nodes
        feats, toks, pos = [], [], []
        for i in expand:
            node = nodes[i]
            parent_entry = nodes[node.parent].entry if node.parent >= 0 else -1
            feats.append(self._root_hidden if parent_entry < 0
                         else self._entry_hidden[parent_entry])
            toks.append(node.token)
            pos.append(work.n + node.depth - 1)
        n_past = self._n_entries
        n_draft = len(entry_nodes)
        mask = torch.zeros(len(expand), n_past + n_draft + len(expand), dtype=torch.bool,
                           device=dev)
        mask[:, :n_past] = True
        for r, i in enumerate(expand):
            mask[r, n_past + n_draft + r] = True
            anc = nodes[i].parent
            while anc >= 0:
                mask[r, n_past + nodes[anc].entry] = True
                anc = nodes[anc].parent
        if self._cache[0].length != n_past + n_draft:
            raise RuntimeError("the head's cache is out of step with its draft")
        out, _ = self.head(torch.stack(feats)[None], torch.tensor(toks, device=dev)[None],
                           torch.tensor(pos, device=dev)[None], self._cache, mask)
        hidden = out[0]
        if n_draft == 0:
            self._entry_hidden = hidden
        else:
            self._entry_hidden = torch.cat([self._entry_hidden, hidden])
        for r, i in enumerate(expand):
            nodes[i].entry = n_draft + r
            entry_nodes.append(i)
        return hidden

    def _select(self, nodes: list[_Node], max_tokens: int) -> DraftTree:
        """The best ``max_tokens`` nodes (a path product never beats its parent's, so
        the set is closed under ancestors), parents first, calibrated scores."""
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth))
        chosen = set()
        for i in order:
            if len(chosen) >= max_tokens or nodes[i].score < 0:
                break
            if nodes[i].parent < 0 or nodes[i].parent in chosen:
                chosen.add(i)
        tree = DraftTree()
        index: dict[int, int] = {}
        raw: list[float] = []
        node_ids: list[int] = []
        for i in sorted(chosen, key=lambda i: (nodes[i].depth, i)):
            node = nodes[i]
            parent = index[node.parent] if node.parent >= 0 else -1
            if tree.child_with_token(parent, node.token) is not None:
                continue  # a duplicate sibling (cannot happen with distinct top-k)
            score = min(1.0, node.score * self.calibration.factor(node.depth))
            index[i] = tree.add(node.token, parent, score)
            raw.append(node.score)
            node_ids.append(i)
        self._last_draft, self._raw_scores, self._served_nodes = tree, raw, node_ids
        return tree

    def pin(self) -> None:
        if self.config.dynamic_depth:
            self.config = replace(self.config, dynamic_depth=False)

    def stats(self) -> dict[str, float]:
        calls = max(1, self._n_head_calls)
        return {"head_ms_per_call": 1000 * self._t_head_s / calls}


def load_head_drafter(head_dir: Path, model_path: Path, target: TargetFingerprint,
                      config: HeadDrafterConfig | None = None, device: str = "cpu",
                      draft_vocab_size: int = 0) -> HeadDrafter:
    """A drafter for the target at ``model_path`` (whose fingerprint is ``target``) from
    the head saved in ``head_dir`` (Tandem's head.json + head.safetensors, or a public
    EAGLE-1 checkpoint). ``draft_vocab_size`` keeps that many LM-head rows of an EAGLE-1
    head (0: all). Raises what ``check_head_fits`` raises, and ValueError naming the file
    when the weights are not this head's."""
    from models.eagle1_config import weights_file
    from models.eagle1_io import load_eagle1
    from models.head_io import WEIGHTS, load_head

    check_head_fits(head_dir, target)
    weights = cached_target_for_head(model_path)
    with warnings.catch_warnings():
        # Read-only arrays shared by every head of this model: the head never writes
        # them (torch warns that it could).
        warnings.simplefilter("ignore", UserWarning)
        embed, lm_head = torch.from_numpy(weights.embed), torch.from_numpy(weights.lm_head)
    eagle1 = is_eagle1_dir(head_dir)
    path = weights_file(head_dir) if eagle1 else Path(head_dir) / WEIGHTS
    try:
        if eagle1:
            keep: frozenset[int] = frozenset()
            if draft_vocab_size:  # the end tokens stay draftable in any subset
                from engine.runtime.model_info import read_model_info

                keep = read_model_info(model_path).eog_ids
            head = load_eagle1(Path(head_dir), embed, lm_head, device, draft_vocab_size, keep)
        else:
            head = load_head(Path(head_dir), embed, lm_head, device=device)
    except Exception as exc:  # noqa: BLE001 - torch and safetensors raise many kinds
        # On a GPU a failure may be the device's (none, out of memory): let it through
        # so the caller can try the CPU. On the CPU it is the files'.
        if device != "cpu" or isinstance(exc, FileNotFoundError | MemoryError) or (
                "out of memory" in str(exc).lower()):
            raise
        if isinstance(exc, ValueError) and str(path) in str(exc):
            raise  # already names the file and what is wrong in it
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path} does not hold this head's weights ({first_line})") from exc
    config = config or HeadDrafterConfig()
    if device == "cpu" and config.weights == "int8" and int8_available():
        head = head.to_int8()
    drafter = HeadDrafter(head, config)
    if eagle1:
        drafter.load_notes = [f"the EAGLE-1 head in {head_dir}: {EAGLE1_UNCHECKED}"]
    return drafter


_TARGETS: dict[Path, TargetForHead] = {}


def cached_target_for_head(model_path: Path) -> TargetForHead:
    """Dequantized embeddings are ~200 MB of float32: read once per model per process."""
    key = Path(model_path).resolve()
    if key not in _TARGETS:
        _TARGETS.clear()
        _TARGETS[key] = target_for_head(key)
    return _TARGETS[key]
