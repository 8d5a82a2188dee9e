"""Chat formatting from the GGUF's own Jinja template (``tokenizer.chat_template``)."""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable
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


class _Marks:
    """Stand-ins for outside text while the template renders: ASCII words no text holds
    (a fresh nonce each render), which ``tojson`` passes through unchanged and which this
    filter's own output flags as JSON-escaped. ``split`` puts the texts back as plain
    parts."""

    def __init__(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> None:
        everything = "".join(outside_texts(messages, tools))
        self.nonce = secrets.token_hex(6)
        while self.nonce in everything:
            self.nonce = secrets.token_hex(6)
        self.texts: list[str] = []
        self.required: set[int] = set()
        self.raw = re.compile(rf"@@{self.nonce}-(\d+)@@")
        self.any = re.compile(rf"@@{self.nonce}(?:-j([01]))?-(\d+)@@")

    def add(self, text: str, required: bool = False) -> str:
        self.texts.append(text)
        if required:
            self.required.add(len(self.texts) - 1)
        return f"@@{self.nonce}-{len(self.texts) - 1}@@"

    def replace_unsafe(self, value: Any, unsafe: Callable[[str], bool] | None) -> Any:
        """``value`` with every string (keys too) that ``unsafe`` flags as a stand-in."""
        if unsafe is None:
            return value
        if isinstance(value, str):
            return self.add(value) if unsafe(value) else value
        if isinstance(value, dict):
            return {self.replace_unsafe(k, unsafe): self.replace_unsafe(v, unsafe)
                    for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.replace_unsafe(v, unsafe) for v in value]
        return value

    def tojson(self, value: Any, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False,
               ensure_ascii: bool = False) -> str:
        """``_tojson``, its stand-ins flagged: their texts go back JSON-escaped."""
        flag = "1" if ensure_ascii else "0"
        return self.raw.sub(lambda m: f"@@{self.nonce}-j{flag}-{m.group(1)}@@",
                            _tojson(value, indent, separators, sort_keys, ensure_ascii))

    def split(self, text: str) -> list[tuple[str, bool]] | None:
        parts: list[tuple[str, bool]] = []
        seen: set[int] = set()
        last = 0
        for found in self.any.finditer(text):
            index = int(found.group(2))
            if index >= len(self.texts):
                return None
            original = self.texts[index]
            if found.group(1) is not None:  # written by tojson: a JSON string's inside
                original = json.dumps(original, ensure_ascii=found.group(1) == "1")[1:-1]
            parts += [(text[last:found.start()], True), (original, False)]
            seen.add(index)
            last = found.end()
        parts.append((text[last:], True))
        if self.required - seen or any(markup and self.nonce in t for t, markup in parts):
            return None  # a message's text left out, or a stand-in cut or changed
        return [(t, markup) for t, markup in parts if t]


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
                     enable_thinking: bool | None = None, tools: list[dict] | None = None,
                     unsafe: Callable[[str], bool] | None = None
                     ) -> list[tuple[str, bool]] | None:
        """The prompt as (text, is_markup) parts: the template's own markup, whose control
        tokens are real, and outside text, which must be tokenized as plain text (a user
        typing ``<|im_end|>`` must not end their turn; neither may a tool's description,
        a schema, a call's arguments or a result). Each message's text and reasoning is
        always kept apart; a string anywhere in ``tools`` or in a message's other fields
        (calls, names) is kept apart when ``unsafe`` says it holds control-token text
        (the template reads those strings: ones it compares, such as ``"function"``, stay
        as they are). A text the template writes through ``tojson`` comes back
        JSON-escaped, still as plain text. None when the template transforms texts
        beyond recognition (then only ``render`` is possible) or leaves a text out in a
        way the marks cannot follow."""
        marks = _Marks(messages, tools)
        stand_ins = []
        for m in messages:
            stand_in = {}
            for key, value in m.items():
                if key in ("content", "reasoning_content"):
                    # (an empty text needs no protecting, and may be left out)
                    stand_in[key] = marks.add(value, required=key == "content") \
                        if value else value
                elif key == "role":
                    stand_in[key] = value
                else:
                    stand_in[key] = marks.replace_unsafe(value, unsafe)
            stand_ins.append(stand_in)
        offered = marks.replace_unsafe(tools, unsafe) if tools else tools
        text = self.render(stand_ins, add_generation_prompt, enable_thinking, offered,
                           json_marks=marks)
        return marks.split(text)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tools: list[dict] | None = None,
               json_marks: _Marks | None = None) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``, and
        ``reasoning_content`` for an assistant's earlier reasoning, ``tool_calls`` for
        its calls); ``enable_thinking`` goes to templates that read it (None: the
        template's default), ``tools`` (OpenAI's function list) to templates that
        offer functions (engine.tool_syntax)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson if json_marks is None else json_marks.tojson
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


def outside_texts(messages: list[dict[str, Any]], tools: list[dict] | None) -> list[str]:
    """Every string that came from outside the template: the messages' (but their roles)
    and the tools'."""
    found: list[str] = []
    for m in messages:
        for key, value in m.items():
            if key != "role":
                _strings(value, found)
    _strings(tools, found)
    return found


def _strings(value: Any, found: list[str]) -> None:
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _strings(key, found)
            _strings(item, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _strings(item, found)


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
    checked: dict[str, bool] = {}

    def unsafe(text: str) -> bool:
        """Whether ``text`` holds control-token text (it tokenizes otherwise when
        special tokens are parsed)."""
        if text not in checked:
            checked[text] = model.tokenize(text, add_special=False, parse_special=True) != \
                model.tokenize(text, add_special=False, parse_special=False)
        return checked[text]

    parts = template.render_parts(messages, add_generation_prompt, enable_thinking, tools,
                                  unsafe)
    if parts is None:
        if any(unsafe(t) for t in outside_texts(messages, tools)):
            raise InvalidPromptError(
                "this model's chat template rewrites message texts, so Tandem cannot keep "
                "them apart from its markup, and a message (or a tool) holds the model's "
                "control-token text (such as <|im_end|>): it would become real control "
                "tokens, so the conversation is refused")
        log.warning("the chat template rewrites message texts; tokenizing it whole")
        text = template.render(messages, add_generation_prompt, enable_thinking, tools)
        return model.tokenize(text, add_special=False, parse_special=True)
    tokens: list[int] = []
    for text, markup in parts:
        tokens += model.tokenize(text, add_special=False, parse_special=markup)
    return tokens
