"""Chat formatting from the GGUF's own Jinja template (``tokenizer.chat_template``)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidPromptError
from engine.runtime.reasoning import for_template, has_thinking_switch

log = logging.getLogger(__name__)

# Used only when a GGUF carries no template: ChatML, the most common instruct format.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


ROLES = ("system", "user", "assistant", "tool")  # "tool": a function's result
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


class _Tokenizer(Protocol):
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...
    bos_id: int
    eog_ids: frozenset[int]


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """JSON as templates expect it (transformers' and llama.cpp's ``tojson``): Jinja's
    own escapes ``<``, ``>``, ``&`` and ``'`` for HTML, which a prompt must not."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


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

    @property
    def thinking_switch(self) -> bool:
        """Whether a conversation can turn the model's thinking off (the template reads
        ``enable_thinking``)."""
        return has_thinking_switch(self.source)

    def render_parts(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                     enable_thinking: bool | None = None, tools: list[dict] | None = None
                     ) -> list[tuple[str, bool]] | None:
        """The prompt as (text, is_markup) parts: the template's own markup, whose control
        tokens are real, and each message's text (and reasoning), which must be
        tokenized as plain text (a user typing ``<|im_end|>`` must not end their turn).
        None when the template transforms message texts beyond recognition (then only
        ``render`` is possible) or leaves a text out in a way the marks cannot follow."""
        texts: dict[str, str] = {}
        stand_ins = []
        for i, m in enumerate(messages):
            stand_in = dict(m)
            for key in ("content", "reasoning_content"):
                if m.get(key):  # (an empty text needs no protecting, and may be left out)
                    mark = f"\x00\x01{i}{key[0]}\x01\x00"
                    texts[mark] = m[key]
                    stand_in[key] = mark
            stand_ins.append(stand_in)
        text = self.render(stand_ins, add_generation_prompt, enable_thinking, tools)
        parts: list[tuple[str, bool]] = []
        pattern = re.compile("\x00\x01\\d+[cr]\x01\x00")
        last = 0
        for found in pattern.finditer(text):
            mark = found.group(0)
            if mark not in texts:
                return None
            parts += [(text[last:found.start()], True), (texts.pop(mark), False)]
            last = found.end()
        parts.append((text[last:], True))
        # Every message's text appears once (reasoning may be left out by the template).
        if any("c" in mark for mark in texts):
            return None
        return [(t, markup) for t, markup in parts if t]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tools: list[dict] | None = None) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``, and
        ``reasoning_content`` for an assistant's earlier reasoning, ``tool_calls`` for
        its calls); ``enable_thinking`` goes to templates that read it (None: the
        template's default), ``tools`` (OpenAI's function list) to templates that
        offer functions (engine.tool_syntax)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        extra: dict[str, Any] = {} if enable_thinking is None else {
            "enable_thinking": enable_thinking}
        if tools:
            extra["tools"] = tools
        try:
            template = env.from_string(self.source)
            return template.render(messages=messages,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token,
                                   **extra)
        except jinja2.TemplateError as exc:  # its raise_exception: roles out of order...
            raise InvalidPromptError(f"the model's chat template refuses this conversation: "
                                     f"{exc}") from exc


def chat_tokens(model: _Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                tools: list[dict] | None = None) -> list[int]:
    """Tokens of a conversation formatted with ``template`` (with the assistant's opening
    when ``add_generation_prompt``). An earlier answer's reasoning section goes to the
    template apart (engine.runtime.reasoning); ``enable_thinking`` and ``tools``
    (engine.tool_syntax) to templates that read them."""
    check_messages(messages)
    messages = for_template(messages)
    # The template writes BOS itself when the model wants one. Only its markup may
    # become control tokens: the messages' own text is tokenized as text.
    parts = template.render_parts(messages, add_generation_prompt, enable_thinking, tools)
    if parts is None:
        log.warning("the chat template rewrites message texts; tokenizing it whole")
        text = template.render(messages, add_generation_prompt, enable_thinking, tools)
        return model.tokenize(text, add_special=False, parse_special=True)
    tokens: list[int] = []
    for text, markup in parts:
        tokens += model.tokenize(text, add_special=False, parse_special=markup)
    return tokens
