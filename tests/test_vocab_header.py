"""Vocabulary facts read from GGUF headers (no llama.cpp load) against what llama.cpp
itself reports for the same files, llama.cpp's defaults for absent keys, a header cut
inside the token list, and a draft of another vocabulary refused naming the fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFValueType

from engine.errors import IncompatibleDraftError
from engine.gguf.draft_compat import check_draft_model, mismatches, unchecked
from engine.gguf.vocab_header import header_vocab, read_file_vocab, read_section
from engine.runtime.model_info import read_vocab_facts
from tests.vocab_gguf import Fields, other_vocab, write_vocab_gguf


def test_header_facts_equal_llama_facts(model_path: Path, f32_model_path: Path) -> None:
    for path in (model_path, f32_model_path):
        header, loaded = read_file_vocab(path), read_vocab_facts(path)
        assert header is not None and header.complete
        assert header == loaded  # type, BOS/EOS flags and ids, every token's text
    assert read_file_vocab(model_path).vocab_type == "BPE"


def _value(value: object, vtype: int) -> tuple[object, int, None]:
    return (value, vtype, None)


def _pre(pre: str, *drop: str):
    def edit(f: Fields) -> None:
        f["tokenizer.ggml.pre"] = _value(pre, GGUFValueType.STRING)
        for key in drop:
            del f[key]
    return edit


def _spm_defaults(f: Fields) -> None:
    other_vocab(f)
    del f["tokenizer.ggml.add_bos_token"], f["tokenizer.ggml.bos_token_id"]


def _t5_defaults(f: Fields) -> None:
    f["tokenizer.ggml.model"] = _value("t5", GGUFValueType.STRING)
    for key in ("add_bos_token", "bos_token_id", "eos_token_id"):
        del f[f"tokenizer.ggml.{key}"]


def _bos_past_vocab(f: Fields) -> None:
    f["tokenizer.ggml.bos_token_id"] = _value(999_999, GGUFValueType.UINT32)


# (edit, (type, add BOS, BOS id, add EOS, EOS id)) - the expectation is llama.cpp's
# own, asserted below against a vocabulary-only load of the same file.
DEFAULTS = {
    "llama3 pre-tokenizer adds BOS": (_pre("llama-bpe", "tokenizer.ggml.add_bos_token"),
                                      ("BPE", True, 1, False, 2)),
    "other BPE adds nothing": (_pre("smollm", "tokenizer.ggml.add_bos_token"),
                               ("BPE", False, 1, False, 2)),
    "SentencePiece adds BOS 1": (_spm_defaults, ("SentencePiece", True, 1, False, 2)),
    "Unigram adds EOS 1": (_t5_defaults, ("Unigram", False, -1, True, 1)),
    "ChatGLM has no BOS": (_pre("chatglm-bpe", "tokenizer.ggml.bos_token_id"),
                           ("BPE", False, -1, False, 2)),
    "Gemma 4 always adds BOS": (_pre("gemma4"), ("BPE", True, 1, False, 2)),
    "an id past the vocabulary keeps the default": (_bos_past_vocab,
                                                    ("BPE", False, 11, False, 2)),
}


@pytest.mark.parametrize("case", list(DEFAULTS))
def test_defaults_for_absent_keys_are_llama_cpps(case: str, model_path: Path,
                                                 tmp_path: Path) -> None:
    edit, expected = DEFAULTS[case]
    path = write_vocab_gguf(tmp_path / "v.gguf", model_path, edit=edit)
    header = read_file_vocab(path)
    assert header is not None
    got = (header.vocab_type, header.add_bos, header.bos_id, header.add_eos, header.eos_id)
    assert got == expected
    assert header == read_vocab_facts(path)


def test_another_vocabulary_is_refused_naming_fields(model_path: Path, tmp_path: Path) -> None:
    other = write_vocab_gguf(tmp_path / "other.gguf", model_path, edit=other_vocab)
    draft, target = read_file_vocab(other), read_file_vocab(model_path)
    assert draft is not None and target is not None
    found = dict((name, (mine, theirs)) for name, mine, theirs in mismatches(draft, target))
    assert found == {"vocabulary type": ("SentencePiece", "BPE"),
                     "text of token 100": ("x" + target.texts[100].decode(),
                                           target.texts[100].decode())}
    with pytest.raises(IncompatibleDraftError, match="vocabulary type") as info:
        check_draft_model(draft, target)
    assert "text of token 100" in str(info.value)
    # The same vocabulary in another file passes.
    same = write_vocab_gguf(tmp_path / "same.gguf", model_path)
    check_draft_model(read_file_vocab(same), target)  # type: ignore[arg-type]


def test_a_prefix_cut_inside_the_token_list(model_path: Path) -> None:
    data = model_path.read_bytes()[:400_000]  # the token list runs to ~1 MB
    section = read_section(data)
    assert not section.complete and section.cut_key == "tokenizer.ggml.tokens"
    cut = header_vocab(section, "cut")
    full = read_file_vocab(model_path)
    assert cut is not None and full is not None
    assert cut.n_vocab == 49152 and 0 < len(cut.texts) < 49152
    assert cut.texts == full.texts[:len(cut.texts)]
    # add_bos_token comes before the tokens in this file; the ids come after them.
    assert (cut.vocab_type, cut.add_bos, cut.bos_id, cut.eos_id) == ("BPE", False, None, None)
    assert mismatches(cut, full) == []  # nothing known differs...
    gaps = unchecked(cut, full)  # ...and what could not be checked is said
    assert "BOS/EOS handling" in gaps
    assert any(f"from id {len(cut.texts)} on" in g for g in gaps)
    # Before the token list's length there is nothing to check against.
    before = data.index(b"tokenizer.ggml.tokens")
    assert header_vocab(read_section(data[:before]), "tiny") is None
