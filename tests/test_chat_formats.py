"""Models without a chat template, and base models: a base model continues text, an
instruct model gets the format its vocabulary's control tokens name, and the engine says
which (engine.runtime.template_choice)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gguf.architectures import write_architecture_gguf
from engine.runtime.chat_template import CHATML
from engine.runtime.target import Target, TargetConfig
from engine.runtime.template_choice import PLAIN_TEXT, choose_template, model_kind
from engine.session import Engine, EngineConfig

CHAT = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory: pytest.TempPathFactory, model_path: Path
                ) -> dict[str, Path]:
    """Tiny llama files with the bundled vocabulary and no chat template, named as a base
    model, as an instruct model, and as nothing in particular."""
    folder = tmp_path_factory.mktemp("untemplated")
    names = {"base": "Tiny-1B-Base", "instruct": "Tiny-1B-Instruct", "unnamed": "Tiny-1B"}
    return {kind: write_architecture_gguf("llama", folder / f"{name}.gguf", model_path,
                                          chat_template=False, name=name)
            for kind, name in names.items()}


def test_a_base_model_continues_the_text(untemplated: dict[str, Path]) -> None:
    for kind in ("base", "unnamed"):  # no template, nothing says instruct: a base model
        with Target(untemplated[kind], TargetConfig(n_ctx=256, n_threads=2)) as target:
            assert target.template.completion, kind
            prompt = target.chat_prompt(CHAT)
            text = target.tokenize("Once upon a time", special=False)
            # The user's words, no markup at all (this vocabulary adds no BOS).
            assert not target.model.add_bos and prompt == text


def test_an_instruct_model_without_a_template_gets_its_vocabularys_format(
        untemplated: dict[str, Path]) -> None:
    with Target(untemplated["instruct"], TargetConfig(n_ctx=256, n_threads=2)) as target:
        assert not target.template.completion
        assert target.template.source == CHATML  # the vocabulary has ChatML's tokens
        assert target.template.origin.startswith("ChatML (the file has none")
        text = target.detokenize(target.chat_prompt(CHAT))
        assert text.startswith("<|im_start|>user\nOnce upon a time<|im_end|>")


def test_the_engine_says_what_it_chose(untemplated: dict[str, Path], model_path: Path,
                                       tmp_path: Path) -> None:
    config = EngineConfig(model_path=untemplated["base"], drafter="none", n_ctx=256,
                          n_threads=2, cache_dir=tmp_path, memory_dir=tmp_path)
    with Engine(config) as engine:
        assert any("is a base model, as its name or tags say base: it continues your text"
                   in n for n in engine.notes), engine.notes
        out = engine.generate(engine.chat_prompt(CHAT), _few_tokens())
        assert len(out.tokens) == 4
    config = EngineConfig(model_path=model_path, drafter="none", n_ctx=256, n_threads=2,
                          cache_dir=tmp_path, memory_dir=tmp_path)
    with Engine(config) as engine:  # the bundled model has its own template: no note
        assert engine.target.template.origin == "the model's own"
        assert not any("chat" in n for n in engine.notes)


def _few_tokens():  # noqa: ANN202
    from engine.decoding.generation import GenerationConfig

    return GenerationConfig(4)


class _Facts:
    """A model's facts as the chooser reads them: a vocabulary without any known format's
    control tokens (no real file here has such a vocabulary)."""

    bos_id = 0
    add_bos = True
    eog_ids = frozenset({1})

    def __init__(self, name: str, template: str | None = None) -> None:
        self.name, self.template = name, template

    def chat_template(self) -> str | None:
        return self.template

    def metadata(self, key: str) -> str | None:
        return self.name if key == "general.name" else None

    def pieces(self) -> list[bytes]:
        return [b"<s>", b"</s>", b"hello", b" world"]


def test_names_and_tags_tell_base_from_instruct() -> None:
    cases = {"Qwen2.5-7B-Instruct": False, "gemma-3-1b-it": False, "Llama-3.1-8B": True,
             "gemma-3-1b-pt": True, "Mistral-7B-v0.1-Base": True, "Phi-3-mini-chat": False}
    for name, base in cases.items():
        assert model_kind(_Facts(name), "model.gguf").base == base, name
    # A template but a base model's name: still a base model (and the template is used).
    assert model_kind(_Facts("Qwen2.5-7B-Base", "{{ x }}"), "m.gguf").base
    assert not model_kind(_Facts("Qwen2.5-7B", "{{ x }}"), "m.gguf").base
    chosen = choose_template(_Facts("Tiny-Chat"), "tiny.gguf")
    assert chosen.source == "{{ bos_token }}" + PLAIN_TEXT
    assert chosen.origin.startswith("plain text")
    assert chosen.render(CHAT) == "<s>User: Once upon a time\n\nAssistant:"
