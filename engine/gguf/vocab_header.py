"""Vocabulary facts from a GGUF's metadata alone, without llama.cpp.

The pairing of a draft with a target has to be known before anything is downloaded
(from a ranged read of a remote header) and without loading models on the GUI thread.
This reads what ``engine.gguf.draft_compat.mismatches`` compares straight from the header,
with the defaults llama.cpp applies when a key is absent: ``llama_vocab::impl::load``
in llama-cpp-python 0.3.36's vendored llama.cpp (src/llama-vocab.cpp). A test checks
the result equals the facts llama.cpp reports for the same file."""

from __future__ import annotations

import mmap
from functools import lru_cache
from pathlib import Path

from engine.gguf.draft_compat import VocabFacts
from engine.gguf.header import (
    GGUFFacts,
    KVSection,
    check_gguf_magic,
    facts_from_kv,
    read_kv_section,
)

TOKENS_KEY = "tokenizer.ggml.tokens"
NO_TOKEN = -1  # LLAMA_TOKEN_NULL

# tokenizer.ggml.model -> the vocabulary type, named as draft_compat names llama.cpp's.
VOCAB_TYPES = {"no_vocab": "none", "none": "none", "llama": "SentencePiece", "gpt2": "BPE",
               "hybriddna": "BPE", "whitespace": "BPE", "gemma4": "BPE", "bert": "WordPiece",
               "t5": "Unigram", "rwkv": "RWKV", "test": "test", "plamo2": "PLaMo-2"}
# Default (BOS, EOS) ids per tokenizer model, before the header's own ids.
_DEFAULT_IDS = {"llama": (1, 2), "bert": (101, NO_TOKEN), "gpt2": (11, 11),
                "hybriddna": (11, 11), "whitespace": (11, 11), "t5": (NO_TOKEN, 1),
                "plamo2": (1, 2)}
# Default (add BOS, add EOS) per vocabulary type; BPE and the rest add neither...
_DEFAULT_ADD = {"SentencePiece": (True, False), "WordPiece": (True, False),
                "Unigram": (False, True)}
# ...except BPE vocabularies with these pre-tokenizers, which add BOS (Llama 3 among them).
_BPE_ADD_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                          "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken",
                          "chameleon"})
_BPE_NO_BOS_ID = frozenset({"chatglm-bpe", "glm4", "glm5"})  # these have no BOS token
# Gemma 4's pre-tokenizer always adds BOS, whatever the header says (llama.cpp #21500).
_GEMMA4_PRE = frozenset({"gemma4", "granite-embed-multi-311m"})


def _known(section: KVSection, key: str) -> tuple[bool, object]:
    """(whether the key's value is known, the value or None when absent). A key past
    the end of a cut prefix is unknown; one absent from a complete header is known
    absent."""
    if key in section.kv and key != section.cut_key:
        return True, section.kv[key]
    return section.complete, None


def header_vocab(section: KVSection, name: str) -> VocabFacts | None:
    """The vocabulary facts of a GGUF header, or None when it has no token list (or the
    prefix ended before its length). Values the prefix did not reach are None; a token
    list it cut keeps the texts read so far (``VocabFacts.n_tokens`` gives the size)."""
    tokens = section.kv.get(TOKENS_KEY)
    if not isinstance(tokens, tuple) or tokens[2] is None:
        return None
    n_tokens, texts = int(tokens[1]), tuple(tokens[2])
    has_model, model = _known(section, "tokenizer.ggml.model")
    _, pre = _known(section, "tokenizer.ggml.pre")
    model = model if isinstance(model, str) else None
    pre = pre if isinstance(pre, str) else ""
    if model is None:  # past the prefix, or (llama.cpp refuses such a file) missing
        vocab_type = "no tokenizer model" if has_model else None
    else:
        vocab_type = VOCAB_TYPES.get(model, f"unknown tokenizer {model!r}")
    if model == "gemma4":
        pre = "gemma4"  # llama.cpp sets it so for this tokenizer model

    # Special ids: the type's defaults (disabled when past the vocabulary), then the
    # header's own when they lie inside the vocabulary.
    bos, eos = _DEFAULT_IDS.get(model or "", (NO_TOKEN, NO_TOKEN))
    if vocab_type == "BPE" and pre in _BPE_NO_BOS_ID:
        bos = NO_TOKEN
    ids: list[int | None] = []
    for default, key in ((bos, "tokenizer.ggml.bos_token_id"),
                         (eos, "tokenizer.ggml.eos_token_id")):
        known, value = _known(section, key)
        default = NO_TOKEN if default >= n_tokens else default
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_tokens:
            ids.append(value)
        else:
            ids.append(default if known and has_model else None)

    add_bos, add_eos = _DEFAULT_ADD.get(vocab_type or "", (False, False))
    if vocab_type == "BPE" and pre in _BPE_ADD_BOS:
        add_bos = True
    flags: list[bool | None] = []
    for default_flag, key in ((add_bos, "tokenizer.ggml.add_bos_token"),
                              (add_eos, "tokenizer.ggml.add_eos_token")):
        known, value = _known(section, key)
        if isinstance(value, bool):
            flags.append(value)
        else:
            flags.append(default_flag if known and has_model else None)
    if vocab_type == "BPE" and pre in _GEMMA4_PRE and flags[0] is not None:
        flags[0] = True
    return VocabFacts(name=name, vocab_type=vocab_type, add_bos=flags[0], bos_id=ids[0],
                      add_eos=flags[1], eos_id=ids[1], texts=texts,
                      n_tokens=None if len(texts) == n_tokens else n_tokens)


def read_section(data: bytes) -> KVSection:
    """The metadata of a GGUF prefix, keeping the token texts. Raises ValueError."""
    return read_kv_section(data, frozenset({TOKENS_KEY}))


@lru_cache(maxsize=64)
def _file_header(path: str, _size: int, _mtime_ns: int
                 ) -> tuple[GGUFFacts, VocabFacts | None]:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        # The mmap pages in only the header: no weights are read.
        section = read_section(data)  # type: ignore[arg-type]
        return facts_from_kv(section.kv), header_vocab(section, Path(path).name)


def read_file_header(path: Path) -> tuple[GGUFFacts, VocabFacts | None]:
    """The shape and vocabulary facts of a local GGUF from its header (cached per file
    version); the vocabulary is None when it has no token list. Raises ModelLoadError
    when it is not a GGUF, ValueError when its header is malformed."""
    check_gguf_magic(path)
    st = Path(path).stat()
    return _file_header(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def read_file_vocab(path: Path) -> VocabFacts | None:
    """The vocabulary facts of a local GGUF from its header: see read_file_header."""
    return read_file_header(path)[1]
