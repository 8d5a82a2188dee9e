"""Log probabilities in OpenAI's two shapes: chat's ``content`` list and text
completions' parallel lists."""

from __future__ import annotations

from typing import Any

from engine.decoding.logprobs import TokenLogprob


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": _text(t.piece), "logprob": t.logprob, "bytes": list(t.piece),
         "top_logprobs": [{"token": _text(p), "logprob": lp, "bytes": list(p)}
                          for _, p, lp in t.top]}
        for t in tokens], "refusal": None}


def text_logprobs(tokens: list[TokenLogprob], start: int = 0) -> dict[str, Any]:
    """``start``: where the first token's text begins in the answer (a streamed chunk's)."""
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(_text(t.piece))
    return {"tokens": [_text(t.piece) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{_text(p): lp for _, p, lp in t.top} for t in tokens],
            "text_offset": offsets}
