"""A chat format for a GGUF that carries none, and base models told from instruct ones.

A file without ``tokenizer.chat_template`` is either a base model (it was never taught to
answer: it continues text) or an instruct model converted without its template. Wrapping a
base model's prompt in ChatML, whose tokens its vocabulary may not have, made it answer in
markup. So: a base model gets its conversation as text to continue; an instruct model gets
the format whose control tokens its vocabulary holds, else a plain-text one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from engine.runtime.chat_template import CHATML, ChatTemplate

_NL = "{{ '\\n' }}"

# Formats by the control tokens that mark them, most specific first.
FAMILY_FORMATS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("Llama 3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
     "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
     "<|end_header_id|>" + _NL + _NL + "{{ m['content'] }}<|eot_id|>{% endfor %}"
     "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
     + _NL + _NL + "{% endif %}"),
    ("Gemma", ("<start_of_turn>", "<end_of_turn>"),
     "{{ bos_token }}{% for m in messages %}<start_of_turn>"
     "{{ 'model' if m['role'] == 'assistant' else 'user' }}" + _NL +
     "{{ m['content'] }}<end_of_turn>" + _NL + "{% endfor %}"
     "{% if add_generation_prompt %}<start_of_turn>model" + _NL + "{% endif %}"),
    ("Phi-3", ("<|user|>", "<|assistant|>", "<|end|>"),
     "{% for m in messages %}<|{{ m['role'] }}|>" + _NL + "{{ m['content'] }}<|end|>" + _NL +
     "{% endfor %}{% if add_generation_prompt %}<|assistant|>" + _NL + "{% endif %}"),
    ("ChatML", ("<|im_start|>", "<|im_end|>"), CHATML),
)
# No control tokens to mark turns: names in plain text. (BOS where the vocabulary adds one.)
_BOS = "{{ bos_token }}"
PLAIN_TEXT = ("{% for m in messages %}"
              "{% if m['role'] == 'user' %}User: {% elif m['role'] == 'assistant' %}"
              "Assistant: {% endif %}{{ m['content'] }}" + _NL + _NL + "{% endfor %}"
              "{% if add_generation_prompt %}Assistant:{% endif %}")
# A base model: the conversation's texts, one after another, to be continued.
COMPLETION = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

_INSTRUCT = re.compile(r"\b(instruct|chat|it|sft|dpo|rlhf|assistant|conversational)\b")
_BASE = re.compile(r"\b(base|pt|pretrained)\b")


class _Model(Protocol):
    def chat_template(self) -> str | None: ...
    def metadata(self, key: str) -> str | None: ...
    def pieces(self) -> list[bytes]: ...
    bos_id: int
    add_bos: bool
    eog_ids: frozenset[int]


@dataclass(frozen=True)
class ModelKind:
    """Base or instruct, and from what that was told."""

    base: bool
    evidence: str


def name_says_base(name: str) -> bool | None:
    """What a model's name (or repository id) says: True for a base model, False for an
    instruct or chat model, None when it says neither."""
    text = re.sub(r"[-_.,/\[\]]", " ", name.lower())
    if _INSTRUCT.search(text):
        return False
    return True if _BASE.search(text) else None


def model_kind(model: _Model, file_name: str) -> ModelKind:
    """Whether the model is a base model: its name, fine-tune or tags say so, or it has
    no chat template and nothing names it an instruct or chat model."""
    fields = [model.metadata(k) or "" for k in
              ("general.name", "general.finetune", "general.basename", "general.tags")]
    said = name_says_base(" ".join(fields + [file_name]))
    if said is not None:
        return ModelKind(said, "its name or tags say " + ("base" if said else "instruct"))
    if not model.chat_template():
        return ModelKind(True, "it has no chat template and nothing names it an instruct "
                               "model")
    return ModelKind(False, "it has a chat template")


def choose_template(model: _Model, file_name: str) -> ChatTemplate:
    """The model's own template; else, for a base model, its conversation as text to
    continue; else the format whose control tokens its vocabulary holds; else plain text."""
    if model.chat_template():
        return ChatTemplate.from_model(model)
    kind = model_kind(model, file_name)
    bos = _BOS if model.add_bos else ""
    if kind.base:
        return ChatTemplate.from_model(
            model, bos + COMPLETION, f"a base model, as {kind.evidence}", completion=True)
    vocabulary = set(model.pieces())
    for family, markers, source in FAMILY_FORMATS:
        if all(m.encode() in vocabulary for m in markers):
            return ChatTemplate.from_model(
                model, source, f"{family} (the file has none; its vocabulary has "
                               f"{family}'s control tokens)")
    return ChatTemplate.from_model(
        model, bos + PLAIN_TEXT, "plain text (the file has none, and its vocabulary has no "
                           "known format's control tokens)")
