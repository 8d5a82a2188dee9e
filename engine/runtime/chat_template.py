"""Chat formatting from the GGUF's own Jinja template (``tokenizer.chat_template``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidPromptError

# Used only when a GGUF carries no template: ChatML, the most common instruct format.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


ROLES = ("system", "user", "assistant")
OWN_TEMPLATE = "the model's own"  # ChatTemplate.origin of a GGUF's own template


def check_messages(messages: object) -> None:
    """Raise InvalidPromptError unless ``messages`` is a non-empty list of dicts with a
    known ``role`` and a string ``content``."""
    if not isinstance(messages, list) or not messages:
        raise InvalidPromptError("a conversation must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidPromptError(f"message {i} must be a dict with role and content, "
                                     f"got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise InvalidPromptError(f"message {i} has role {m.get('role')!r}; choose from "
                                     f"{', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InvalidPromptError(f"message {i} must have text content, got "
                                     f"{type(m.get('content')).__name__}")


class _ModelFacts(Protocol):
    def chat_template(self) -> str | None: ...
    def pieces(self) -> list[bytes]: ...
    bos_id: int
    eog_ids: frozenset[int]


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@dataclass
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = OWN_TEMPLATE  # where the template came from, for the plan
    completion: bool = False  # a base model: the conversation is text to continue

    @classmethod
    def from_model(cls, model: _ModelFacts, source: str | None = None, origin: str = "",
                   completion: bool = False) -> ChatTemplate:
        """The model's own template, or ``source`` (chosen by
        engine.runtime.template_choice) when the GGUF has none."""
        pieces = model.pieces()

        def text(tok: int) -> str:
            return pieces[tok].decode("utf-8", "replace") if 0 <= tok < len(pieces) else ""

        eos = min(model.eog_ids) if model.eog_ids else -1
        own = model.chat_template()
        if own:
            return cls(own, text(model.bos_id), text(eos))
        return cls(source or CHATML, text(model.bos_id), text(eos),
                   origin or "ChatML (the file has no template)", completion)

    def render_parts(self, messages: list[dict[str, str]], add_generation_prompt: bool = True
                     ) -> list[tuple[str, bool]] | None:
        """The prompt as (text, is_markup) parts: the template's own markup, whose control
        tokens are real, and each message's text, which must be tokenized as plain text
        (a user typing ``<|im_end|>`` must not end their turn). None when the template
        transforms message texts beyond recognition (then only ``render`` is possible)."""
        marks = [f"\x00\x01{i}\x01\x00" for i in range(len(messages))]
        stand_ins = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        text = self.render(stand_ins, add_generation_prompt)
        parts: list[tuple[str, bool]] = []
        for message, mark in zip(messages, marks, strict=True):
            before, found, text = text.partition(mark)
            if not found or mark in text:
                return None
            parts += [(before, True), (message["content"], False)]
        parts.append((text, True))
        return [(t, markup) for t, markup in parts if t]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            template = env.from_string(self.source)
            return template.render(messages=messages,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as exc:  # its raise_exception: roles out of order...
            raise InvalidPromptError(f"the model's chat template refuses this conversation: "
                                     f"{exc}") from exc
