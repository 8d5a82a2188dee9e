"""Conversations longer than the context (issue 36, item 2): the oldest turns are left
out (the system prompt kept) or the chat stops with a clear error; on a stand-in
template, then on the real model through the engine and the window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.decoding.generation import GenerationConfig
from engine.errors import ContextFullError
from engine.runtime.context_fit import answer_room, fit_messages
from engine.session import Engine, EngineConfig


def _render(messages: list[dict[str, str]]) -> list[int]:
    """Each message: 3 tokens of markup and one per word; 2 for the assistant's opening."""
    out: list[int] = []
    for m in messages:
        out += [0, 0, 0] + [1] * len(m["content"].split())
    return out + [0, 0]


def _chat(n_exchanges: int, words: int = 10) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "be brief " * 3}]
    for i in range(n_exchanges):
        msgs += [{"role": "user", "content": f"q{i} " + "w " * words},
                 {"role": "assistant", "content": f"a{i} " + "w " * words}]
    return msgs + [{"role": "user", "content": "last question"}]


def test_the_oldest_exchanges_go_first_and_the_system_prompt_stays():
    msgs = _chat(20)
    full = _render(msgs)
    fitted = fit_messages(_render, msgs, n_ctx=200, max_tokens=40)
    assert len(fitted.tokens) + answer_room(200, 40) <= 200 < len(full) + 40
    assert fitted.n_dropped % 2 == 0 and fitted.n_dropped > 0  # whole exchanges
    kept = [msgs[0]] + msgs[1 + fitted.n_dropped:]
    assert fitted.tokens == _render(kept)
    assert kept[1]["role"] == "user"
    # The fewest dropped: one exchange more would have fitted too, one fewer would not.
    fewer = [msgs[0]] + msgs[1 + fitted.n_dropped - 2:]
    assert len(_render(fewer)) + answer_room(200, 40) > 200


def test_a_chat_that_fits_is_untouched_and_stop_keeps_everything():
    msgs = _chat(2)
    assert fit_messages(_render, msgs, 4096, 64).n_dropped == 0
    long = _chat(50)
    stopped = fit_messages(_render, long, 200, 40, policy="stop")
    assert stopped.n_dropped == 0 and stopped.tokens == _render(long)
    with pytest.raises(ValueError, match="unknown context policy"):
        fit_messages(_render, msgs, 200, 40, policy="rolling")


def test_a_last_message_longer_than_the_context_is_left_for_the_refusal():
    msgs = [{"role": "user", "content": "w " * 500}]
    fitted = fit_messages(_render, msgs, 200, 40)
    assert fitted.n_dropped == 0 and len(fitted.tokens) > 200


def test_a_long_chat_runs_to_the_end_and_stays_plain_decoding(model_path: Path, tmp_path):
    """24 turns of up to 16 tokens in a 256-token context (the issue's 100 turns of 64 in
    2,048, scaled to the suite's time; ``python -m tests.long_chat`` runs that one): no
    error, nothing lost, and each answer is plain decoding's for the prompt it was given."""
    config = EngineConfig(model_path=model_path, n_ctx=256, n_threads=2, drafter="memory",
                          cache_dir=tmp_path, memory_dir=tmp_path / "memory")
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    dropped = []
    with Engine(config) as engine:
        for turn in range(24):
            messages.append({"role": "user", "content": f"Give me fact number {turn} "
                                                        "about the sea."})
            fitted = engine.fit_chat(messages, 16)
            assert len(fitted.tokens) + 16 <= engine.target.n_ctx
            out = engine.generate(fitted.tokens, GenerationConfig(16))
            assert out.finish_reason in ("eos", "length")
            if turn % 12 == 11:  # now and then: the drafted answer is the plain one
                engine.target.reset()
                plain = engine.generate(fitted.tokens, GenerationConfig(16), plain=True)
                assert plain.tokens == out.tokens
            messages.append({"role": "assistant", "content": out.text})
            dropped.append(fitted.n_dropped)
        assert len(messages) == 49  # every message kept in the chat itself
        assert dropped[0] == 0 and dropped[-1] >= 30  # the context holds the last few
        assert dropped == sorted(dropped) and all(d % 2 == 0 for d in dropped)
        with pytest.raises(ContextFullError):  # "stop": the old refusal, clear
            engine.generate(engine.fit_chat(messages, 16, "stop").tokens, GenerationConfig(16))


def test_the_window_marks_what_it_left_out(qtbot, tmp_path: Path, model_path: Path):
    from tests.gui_helpers import ANSWER_TIMEOUT_MS, open_window, send_and_wait

    w = open_window(qtbot, tmp_path / "chat.sqlite3", model_path, max_tokens=48)
    with qtbot.waitSignal(w.engine_ready, timeout=ANSWER_TIMEOUT_MS):
        w.load_engine(replace(w.engine_panel.choice(), n_ctx=256))
    assert w.settings_panel.context_policy.currentData() == "drop_oldest"
    outcome = None
    for i in range(8):
        outcome = send_and_wait(qtbot, w, f"Tell me about the number {i} in two sentences.")
        if outcome.n_dropped:
            break
    assert outcome is not None and outcome.n_dropped > 0
    last = w.store.messages(w.controller.current_id)[-1]
    assert last.info["context_dropped"] == outcome.n_dropped
    assert "oldest messages were left out" in last.info["summary"]
    assert len(w.store.messages(w.controller.current_id)) == 2 * (i + 1)  # none lost
    # The messages the model no longer sees are dimmed in the transcript, the rest not.
    from app.gui.transcript_model import OUT_OF_CONTEXT_ROLE

    rows = [w.transcript.index(r).data(OUT_OF_CONTEXT_ROLE)
            for r in range(w.transcript.rowCount())]
    assert rows == [True] * outcome.n_dropped + [False] * (len(rows) - outcome.n_dropped)
