"""Conversations longer than the context: which turns the next prompt keeps.

``drop_oldest`` (the default) keeps the system prompt and the newest turns that fit with
room for the answer, dropping whole exchanges from the oldest (the kept part always
starts at a user message, so the template sees a well-formed chat). ``stop`` keeps
everything, and generation then refuses with a clear "context full" error, as before.

Output stays plain decoding's: the shortened conversation is an ordinary prompt, prefilled
like any other (the target reuses the cached prefix it shares, the system prompt). A
llama.cpp context shift would keep more cells but moves K by RoPE, which changes its
numbers: the answer would no longer be the one plain decoding gives for that prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CONTEXT_POLICIES = ("drop_oldest", "stop")
DEFAULT_POLICY = "drop_oldest"
MAX_ANSWER_SHARE = 4  # the room kept for the answer: max_tokens, at most n_ctx / this


@dataclass(frozen=True)
class FittedPrompt:
    tokens: list[int]
    n_dropped: int  # messages left out, oldest first (never the system prompt)


def answer_room(n_ctx: int, max_tokens: int) -> int:
    """Tokens kept free for the answer: what it may use, within a quarter of the context
    (a longer answer stops at the context's end and the next turn drops more)."""
    return max(1, min(max_tokens, n_ctx // MAX_ANSWER_SHARE))


def fit_messages(render: Callable[[list[dict[str, str]]], list[int]],
                 messages: list[dict[str, str]], n_ctx: int, max_tokens: int,
                 policy: str = DEFAULT_POLICY) -> FittedPrompt:
    """The prompt for ``messages`` under ``policy``: ``render`` turns messages into
    tokens (the chat template). When even the last user message alone does not fit,
    that is what comes back, and the prefill refuses it with the context-full error."""
    if policy not in CONTEXT_POLICIES:
        raise ValueError(f"unknown context policy {policy!r} ({', '.join(CONTEXT_POLICIES)})")
    tokens = render(messages)
    room = answer_room(n_ctx, max_tokens)
    if policy == "stop" or len(tokens) + room <= n_ctx:
        return FittedPrompt(tokens, 0)
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"),
                    len(messages))
    system, turns = messages[:n_system], messages[n_system:]
    starts = [i for i, m in enumerate(turns) if m["role"] == "user"]
    # The earliest cut that fits (a prompt only grows with the turns it keeps): a binary
    # search over the user turns, the last of which is always kept.
    lo, hi = 0, len(starts) - 1
    if hi < 0:
        return FittedPrompt(tokens, 0)
    best = render(system + turns[starts[hi]:])
    if len(best) + room > n_ctx:
        return FittedPrompt(best, starts[hi])
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = render(system + turns[starts[mid]:])
        if len(candidate) + room <= n_ctx:
            hi, best = mid, candidate
        else:
            lo = mid + 1
    return FittedPrompt(best, starts[lo])
