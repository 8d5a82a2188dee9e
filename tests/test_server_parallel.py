"""``tandem serve --parallel 4``: four requests decoded together, each answer exactly the
one the same request gets alone, streamed, with log probabilities and a schema too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_server import Served, _serve

QUESTIONS = ["Name three colours of the rainbow.", "What is the capital of France?",
             "Write one sentence about the sea.", "Count from one to five in words."]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def parallel_server(model_path: Path) -> Iterator[Served]:
    yield from _serve(model_path, "--parallel", "4", "--drafter", "none")


def _ask(server: Served, i: int, stream: bool = False) -> tuple[str, list[float]]:
    client = server.client()
    kwargs = {"model": "any", "max_tokens": 32, "temperature": 0,
              "messages": [{"role": "user", "content": QUESTIONS[i]}]}
    if i == 1:
        kwargs["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "city", "schema": SCHEMA}}
    if i == 2:
        kwargs |= {"logprobs": True, "top_logprobs": 2}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        lps = [c.logprob for c in choice.logprobs.content] if choice.logprobs else []
        return choice.message.content or "", lps
    text, lps = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            lps += [c.logprob for c in chunk.choices[0].logprobs.content]
    return "".join(text), lps


def test_answers_together_equal_answers_alone(parallel_server: Served) -> None:
    assert any("4 requests at once" in line for line in parallel_server.lines)
    alone = [_ask(parallel_server, i) for i in range(4)]
    together: list = [None] * 4
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        barrier.wait()
        together[i] = _ask(parallel_server, i, stream=i % 2 == 0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == alone
    assert '"city"' in alone[1][0] and len(alone[2][1]) > 0
    health = parallel_server.health()
    assert health["answered"] == 8 and health["failed"] == 0
