"""Whether verified batches give one-token decoding's logits bit for bit, on this build and
this model file: the probe behind the lossless guarantee.

ggml's CPU backend may multiply a batch with other kernels than one token: repacked weights
(a GEMV below 4 rows, a GEMM from 4) and the tiled K-quant matmul (from 8 rows) sum in
another order, and K-quant logits then differ by up to 1-2.5 between a verified draft and
plain decoding. The probe decodes a short answer one token at a time, then feeds the same
tokens again from a cold cache as verified chains of every size class the budget uses (up to
``MAX_MEMORY_DRAFT + 1``) and compares every position's logits bitwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.runtime.draft_tree import DraftTree
from engine.runtime.target import Target

# Chain lengths (root included) that cross every kernel threshold: repacked GEMM from 4
# rows, the tiled matmul from 8, and the longest chain a memory draft verifies (33).
PROBE_CHAINS = (2, 3, 4, 5, 8, 9, 16, 33)
PROBE_TEXT = ("The lighthouse keeper wrote in his log every evening: the weather, the ships "
              "that passed, and the names of the birds that rested on the rail.")


@dataclass(frozen=True)
class ExactnessProbe:
    """What the probe saw: positions compared, how many differed, by how much at most, and
    how many of them would have chosen another greedy token."""

    positions: int
    differing: int
    max_abs_diff: float
    argmax_flips: int
    chains: tuple[int, ...] = PROBE_CHAINS
    context: int = 0  # tokens in the cache before the first compared position

    @property
    def exact(self) -> bool:
        return self.differing == 0

    def describe(self) -> str:
        where = f" after {self.context} tokens of context" if self.context > 200 else ""
        if self.exact:
            return (f"verified batches of up to {max(self.chains)} tokens gave one-token "
                    f"decoding's logits bit for bit at all {self.positions} positions "
                    f"probed{where}")
        return (f"verified batches differed from one-token decoding at {self.differing} of "
                f"{self.positions} positions{where} (logits by up to "
                f"{self.max_abs_diff:.3g}; {self.argmax_flips} would pick another greedy "
                "token)")

    def to_json(self) -> dict:
        d = asdict(self)
        d["chains"] = list(self.chains)
        return d

    @classmethod
    def from_json(cls, d: dict) -> ExactnessProbe:
        return cls(int(d["positions"]), int(d["differing"]), float(d["max_abs_diff"]),
                   int(d["argmax_flips"]), tuple(int(n) for n in d["chains"]),
                   int(d.get("context", 0)))


def probe_exactness(target: Target, chains: tuple[int, ...] = PROBE_CHAINS,
                    context: int = 0) -> ExactnessProbe:
    """Compare one-token decoding with verified chains of each length in ``chains`` on
    ``target`` as it is loaded, after a prompt of about ``context`` tokens (the probe's
    text repeated; at least its text once), so the batches attend over a long cache.
    Leaves the target's cache empty (cold)."""
    text = target.tokenize(PROBE_TEXT, special=False)
    prompt = list(text)
    if context > len(text):
        while len(prompt) < context:
            prompt += target.tokenize(" " + PROBE_TEXT, special=False)
        prompt = prompt[-context:]
    n_tokens = sum(chains) + 1
    if len(prompt) + n_tokens + 1 > target.n_ctx:
        raise ValueError(f"the probe needs a context of {len(prompt) + n_tokens + 1} tokens")
    # One token at a time, greedy: the reference logits of each position.
    target.reset(cold=True)
    root = int(np.argmax(target.prefill(prompt).logits))
    tokens, reference = [root], []
    for _ in range(n_tokens):
        ver = target.verify(tokens[-1], DraftTree.chain([]))
        reference.append(np.array(ver.logits[0], copy=True))
        target.commit(ver, [0], [tokens[-1]])
        tokens.append(int(np.argmax(reference[-1])))
    # The same tokens again from a cold cache, as verified chains.
    target.reset(cold=True)
    target.prefill(prompt)
    differing, flips, worst, at = 0, 0, 0.0, 0
    for size in chains:
        ver = target.verify(tokens[at], DraftTree.chain(tokens[at + 1:at + size]))
        for j in range(size):
            got, want = ver.logits[j], reference[at + j]
            if not np.array_equal(got, want):
                differing += 1
                worst = max(worst, float(np.max(np.abs(got - want))))
                flips += int(np.argmax(got)) != int(np.argmax(want))
        target.commit(ver, list(range(size)), tokens[at:at + size])
        at += size
    target.reset(cold=True)
    return ExactnessProbe(at, differing, worst, flips, tuple(chains), len(prompt))
