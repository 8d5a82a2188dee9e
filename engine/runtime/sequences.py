"""Token-sequence helpers shared by the target and the drafters' caches."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: what a cache holding ``a`` can
    keep for ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


CUT_PROBE = 16  # tokens of the kept part looked up in the cache


def find_cut(cached: Sequence[int], prompt: Sequence[int], n_same: int,
             min_kept: int) -> tuple[int, int] | None:
    """Where ``prompt`` is ``cached`` with one span cut out right after their common prefix
    of ``n_same`` tokens (a chat whose oldest turns were dropped): the span's length and
    how many cached tokens after it the prompt goes on with; None when no run of at least
    ``min_kept`` tokens follows a cut. The shortest cut wins."""
    probe = list(prompt[n_same:n_same + CUT_PROBE])
    if len(probe) < min(CUT_PROBE, min_kept) or n_same >= len(cached):
        return None
    cached = list(cached)
    start = n_same + 1
    while True:
        try:
            start = cached.index(probe[0], start)
        except ValueError:
            return None
        if cached[start:start + len(probe)] == probe:
            kept = common_prefix_length(cached[start:], prompt[n_same:])
            if kept >= min_kept:
                return start - n_same, kept
        start += 1
