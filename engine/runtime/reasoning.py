"""Reasoning sections of thinking models: ``<think>...</think>`` before the answer.

Thinking models (Qwen3, DeepSeek-R1, QwQ, GLM, ...) write their reasoning between tags
before the answer. The window shows it collapsed; the next turn's prompt gets the answer
as the message's ``content`` and the reasoning apart as ``reasoning_content``, so a
template that keeps earlier reasoning can, and every other template leaves it out (as
those models' own templates do). A template that reads ``enable_thinking`` lets a
conversation turn thinking off.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPEN = re.compile(r"^\s*<(think|thinking|reasoning)>", re.IGNORECASE)


@dataclass(frozen=True)
class Reasoning:
    reasoning: str  # the text between the tags ("" without a section)
    answer: str  # what follows the section (all of the text without one)
    open: bool = False  # the section has not closed yet (still thinking)

    @property
    def has_section(self) -> bool:
        return bool(self.reasoning) or self.open


def split_reasoning(text: str) -> Reasoning:
    """The reasoning section at the start of ``text`` (which may still be streaming)."""
    found = _OPEN.match(text)
    if found is None:
        # Templates that open the section in the prompt leave only its end in the answer.
        closing = text.find("</think>")
        if closing >= 0 and "<think>" not in text[:closing]:
            return Reasoning(text[:closing].strip(), text[closing + 8:].lstrip())
        return Reasoning("", text)
    tag = found.group(1)
    rest = text[found.end():]
    end = re.search(rf"</{tag}>", rest, re.IGNORECASE)
    if end is None:
        return Reasoning(rest.strip(), "", open=True)
    return Reasoning(rest[:end.start()].strip(), rest[end.end():].lstrip())


def for_template(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Assistant messages with their reasoning moved to ``reasoning_content``."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and "reasoning_content" not in m:
            parts = split_reasoning(m["content"])
            if parts.has_section:
                m = {**m, "content": parts.answer, "reasoning_content": parts.reasoning}
        out.append(m)
    return out


def has_thinking_switch(template_source: str) -> bool:
    """Whether a chat template reads ``enable_thinking`` (Qwen3's and its kin's do)."""
    return "enable_thinking" in template_source
