"""Whether a draft language model can draft for a target: llama.cpp's own rules
(``common_speculative_are_compatible``), checked before anything runs.

A draft proposes token ids that the target verifies, so both must mean the same thing by
every id: the same tokenizer type, the same BOS/EOS handling, vocabularies within 128 ids
of each other (Qwen's 7B and 14B embeddings differ by exactly that padding), and the same
token text for every id from 5 on (the first ids are control tokens that families
renumber freely)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import IncompatibleDraftError, describe_mismatches

VOCAB_SIZE_TOLERANCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
FIRST_CHECKED_TOKEN = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID
# llama.cpp's enum llama_vocab_type, in words.
VOCAB_TYPES = {0: "none", 1: "SentencePiece", 2: "BPE", 3: "WordPiece", 4: "Unigram",
               5: "RWKV", 6: "PLaMo-2", 7: "test"}


@dataclass(frozen=True)
class VocabFacts:
    """What the compatibility rules compare, read from one model's vocabulary. Facts
    read from a GGUF header prefix (engine.gguf.vocab_header) may be partial: a value the
    prefix did not reach is None, and ``texts`` may hold only the first ``n_tokens``."""

    name: str
    vocab_type: str | None
    add_bos: bool | None
    bos_id: int | None
    add_eos: bool | None
    eos_id: int | None
    texts: tuple[bytes, ...]  # every token's text, by id (the first ones when cut)
    n_tokens: int | None = None  # the vocabulary's size when ``texts`` is cut short

    @property
    def n_vocab(self) -> int:
        return len(self.texts) if self.n_tokens is None else self.n_tokens

    @property
    def complete(self) -> bool:
        """Whether every fact is known (always, for a model llama.cpp loaded)."""
        return (len(self.texts) == self.n_vocab
                and None not in (self.vocab_type, self.add_bos, self.bos_id, self.add_eos,
                                 self.eos_id))


def _differ(a: object, b: object) -> bool:
    return a is not None and b is not None and a != b


def mismatches(draft: VocabFacts, target: VocabFacts) -> list[tuple[str, object, object]]:
    """(field, the draft's value, the target's value) for every rule the pair breaks.
    Values unknown on either side (partial header facts) break nothing: see
    :func:`unchecked`."""
    out: list[tuple[str, object, object]] = []
    if _differ(draft.vocab_type, target.vocab_type):
        out.append(("vocabulary type", draft.vocab_type, target.vocab_type))
    for what, mine, theirs in (("adds BOS", draft.add_bos, target.add_bos),
                               ("adds EOS", draft.add_eos, target.add_eos)):
        if _differ(mine, theirs):
            out.append((what, mine, theirs))
    if target.add_bos and _differ(draft.bos_id, target.bos_id):
        out.append(("BOS id", draft.bos_id, target.bos_id))
    if target.add_eos and _differ(draft.eos_id, target.eos_id):
        out.append(("EOS id", draft.eos_id, target.eos_id))
    if abs(draft.n_vocab - target.n_vocab) > VOCAB_SIZE_TOLERANCE:
        out.append(("vocabulary size", draft.n_vocab, target.n_vocab))
    for t in range(FIRST_CHECKED_TOKEN, min(len(draft.texts), len(target.texts))):
        if draft.texts[t] != target.texts[t]:
            out.append((f"text of token {t}", draft.texts[t].decode("utf-8", "replace"),
                        target.texts[t].decode("utf-8", "replace")))
            break  # the first difference is enough to name
    return out


def unchecked(draft: VocabFacts, target: VocabFacts) -> list[str]:
    """The rules :func:`mismatches` could not check for lack of facts (a header prefix
    that ended early), in words; empty when every rule was checked."""
    out = []
    if None in (draft.vocab_type, target.vocab_type):
        out.append("the vocabulary type")
    if None in (draft.add_bos, target.add_bos, draft.add_eos, target.add_eos,
                draft.bos_id, target.bos_id, draft.eos_id, target.eos_id):
        out.append("BOS/EOS handling")
    n_read = min(len(draft.texts), len(target.texts))
    if n_read < min(draft.n_vocab, target.n_vocab):
        out.append(f"the token texts from id {max(n_read, FIRST_CHECKED_TOKEN)} on (the "
                   "header read ended inside the token list)")
    return out


def describe(found: list[tuple[str, object, object]]) -> str:
    """Mismatches in words, values quoted (as the wizard and ``tandem models`` show them)."""
    return describe_mismatches(found, quoted=True)


def check_draft_model(draft: VocabFacts, target: VocabFacts) -> None:
    """Raise IncompatibleDraftError naming each rule the pair breaks."""
    found = mismatches(draft, target)
    if found:
        raise IncompatibleDraftError(f"the draft model {draft.name}", found)
