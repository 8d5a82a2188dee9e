"""Constrained decoding: a GBNF grammar's parse state over the target's vocabulary, through
llama.cpp's grammar sampler (``llama_sampler_init_grammar``).

Plain and drafted decoding see one rule (engine.decoding.generation): at every position
the target's logits are constrained by the grammar state after the tokens before it, and
the answer's token is chosen from the constrained row. A drafted token the grammar
forbids is cut before verification; an accepted path advances the state. So a drafted
answer under a grammar equals the plain one under it, greedy and sampled.

llama.cpp's sampler aborts the process when it is made to accept a token it forbids, or an
end of generation before the grammar is complete: ``accept`` checks first. Control
tokens (``<|im_start|>`` passes a JSON string's rule) are never allowed under a grammar,
except the ends of generation, which the grammar allows once it is complete.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidSamplingError
from engine.runtime.native import NativeGrammar, NativeModel, control_tokens

_CANDIDATE = NativeGrammar.CANDIDATE
# Candidates tested at once before the whole vocabulary is masked (greedy's fast path).
_TOP = 64


@dataclass
class _Vocabulary:
    """What every grammar state over one model shares: a candidate buffer for masking,
    the one-character tokens, and which tokens are never allowed (control tokens)."""

    n_vocab: int
    eog: frozenset[int]
    barred: np.ndarray  # bool [n_vocab]: control tokens that do not end generation
    candidates: np.ndarray  # _CANDIDATE [n_vocab]
    singles: np.ndarray  # _CANDIDATE: the tokens that are one character, for forced text
    single_chars: list[str]


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocabulary(model: NativeModel) -> _Vocabulary:
    """The model's vocabulary for grammars, made once per model."""
    vocab = _VOCABULARIES.get(model)
    if vocab is None:
        n = model.n_vocab
        eog = frozenset(model.eog_ids)
        barred = control_tokens(model)
        barred[list(eog)] = False
        candidates = np.zeros(n, _CANDIDATE)
        candidates["id"] = np.arange(n, dtype=np.int32)
        chars: dict[str, int] = {}
        for t, piece in enumerate(model.pieces()):
            text = piece.decode("utf-8", errors="replace")
            if len(text) == 1 and text != "\ufffd" and not barred[t] and t not in eog:
                chars.setdefault(text, t)  # one token per character
        singles = np.zeros(len(chars), _CANDIDATE)
        singles["id"] = list(chars.values())
        vocab = _Vocabulary(n, eog, barred, candidates, singles, list(chars))
        _VOCABULARIES[model] = vocab
    return vocab


class Grammar:
    """One parse state. ``compile`` makes the start state; ``clone`` copies a state;
    ``close`` frees it (states are native objects)."""

    def __init__(self, vocab: _Vocabulary, native: NativeGrammar) -> None:
        self._vocab = vocab
        self._native = native
        self._one = np.zeros(1, _CANDIDATE)
        self._top = np.zeros(_TOP, _CANDIDATE)

    @classmethod
    def compile(cls, model: NativeModel, gbnf: str, root: str = "root") -> Grammar:
        """The start state of ``gbnf`` over ``model``'s vocabulary. Raises
        InvalidSamplingError naming the problem when llama.cpp cannot parse it."""
        vocab = _vocabulary(model)
        native = NativeGrammar.compile(model, gbnf, root)
        if native is None:
            raise InvalidSamplingError(
                "grammar", "llama.cpp could not parse it as GBNF (a syntax error, an "
                f"undefined rule, left recursion or no rule named {root!r})", gbnf[:200])
        return cls(vocab, native)

    def clone(self) -> Grammar:
        return Grammar(self._vocab, self._native.clone())

    def close(self) -> None:
        self._native.close()

    def __del__(self) -> None:  # a state dropped on an error path
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    @property
    def eog(self) -> frozenset[int]:
        return self._vocab.eog

    def allowed(self, token: int) -> bool:
        """Whether the grammar admits ``token`` next."""
        if not 0 <= token < self._vocab.n_vocab or self._vocab.barred[token]:
            return False
        self._one["id"] = token
        self._one["logit"] = 0.0
        self._native.apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def mask(self) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar admits next."""
        cand = self._vocab.candidates
        cand["logit"] = 0.0
        self._native.apply(cand)
        return np.isfinite(cand["logit"]) & ~self._vocab.barred

    def forced_text(self, max_chars: int = 32) -> str:
        """The text the grammar admits as the only way on from here (a JSON key and its
        punctuation after a schema's value, say), character by character up to
        ``max_chars``; "" where more than one character may come next."""
        singles = self._vocab.singles
        out: list[str] = []
        state: Grammar | None = None
        try:
            while len(out) < max_chars:
                singles["logit"] = 0.0
                (state or self)._native.apply(singles)
                ok = np.flatnonzero(np.isfinite(singles["logit"]))
                if len(ok) != 1:
                    break
                if state is None:
                    state = self.clone()
                state.accept(int(singles["id"][ok[0]]))
                out.append(self._vocab.single_chars[ok[0]])
        finally:
            if state is not None:
                state.close()
        return "".join(out)

    def accept(self, token: int) -> None:
        """Advance past ``token`` (not an end of generation: that ends the answer)."""
        if token in self._vocab.eog or not self.allowed(token):
            raise ValueError(f"the grammar does not admit token {token} here")
        self._native.accept(token)

    def constrain(self, logits: np.ndarray, greedy: bool) -> np.ndarray:
        """Logits whose choice is the grammar's: greedy, a row whose argmax is the best
        admitted token (the row itself where its argmax is admitted: masking only lowers
        the others, and np.argmax takes the lowest index of a tie either way); sampling,
        the row with every forbidden token at -inf. Where nothing is admitted, only the
        ends of generation are, so the answer ends. ``logits`` is not modified."""
        if greedy:
            best = int(np.argmax(logits))
            if self.allowed(best):
                return logits
            # The best few tested at once: the highest admitted one wins unless a token
            # outside them could tie it.
            top = np.argpartition(-logits, _TOP - 1)[:_TOP]
            order = top[np.lexsort((top, -logits[top]))]  # best first, ties by id
            self._top["id"] = order
            self._top["logit"] = 0.0
            self._native.apply(self._top)
            ok = np.isfinite(self._top["logit"]) & ~self._vocab.barred[order]
            if ok.any() and len(order) == _TOP:
                first = int(np.argmax(ok))
                if logits[order[first]] > logits[order[-1]]:
                    out = np.full_like(logits, -np.inf)
                    out[order[first]] = logits[order[first]]
                    return out
        allowed = self.mask()
        if not allowed.any():
            allowed = np.zeros_like(allowed)
            allowed[list(self._vocab.eog)] = True
        return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)
