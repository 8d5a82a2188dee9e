"""What a draft head borrows from its target's GGUF: token embedding, LM head, shape facts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.head_config import TargetFingerprint


@dataclass(frozen=True)
class TargetFacts:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    vocab_size: int


def _field(reader, key: str):  # noqa: ANN001 - gguf.GGUFReader
    f = reader.fields.get(key)
    return None if f is None else f.parts[f.data[0]][0]


def read_facts(path: Path) -> TargetFacts:
    """Architecture numbers of a LLaMA-family GGUF."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    return TargetFacts(
        hidden_size=int(_field(r, f"{arch}.embedding_length")),
        n_heads=int(_field(r, f"{arch}.attention.head_count")),
        n_kv_heads=int(_field(r, f"{arch}.attention.head_count_kv")),
        intermediate_size=int(_field(r, f"{arch}.feed_forward_length")),
        rms_eps=float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(r, f"{arch}.rope.freq_base") or 10000.0),
        vocab_size=int(emb.shape[1]),
    )


def read_embeddings(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(token embedding, LM head), each [vocab, hidden] float32, dequantized from the
    GGUF. A model with tied embeddings has no ``output.weight``: the LM head is the
    embedding."""
    import gguf

    r = gguf.GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}

    def load(name: str) -> np.ndarray:
        t = tensors[name]
        out = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(out.reshape(int(t.shape[1]), int(t.shape[0])),
                                    dtype=np.float32)

    embed = load("token_embd.weight")
    lm_head = load("output.weight") if "output.weight" in tensors else embed
    return embed, lm_head


def fingerprint(pieces: list[bytes], hidden_size: int) -> TargetFingerprint:
    """The fingerprint of a target from its token pieces (id order) and hidden size."""
    h = hashlib.sha256()
    for p in pieces:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return TargetFingerprint(vocab_size=len(pieces), hidden_size=hidden_size,
                             tokenizer_sha256=h.hexdigest())


@dataclass(frozen=True)
class TargetForHead:
    """Everything a head takes from its target's GGUF: shapes and frozen matrices."""

    facts: TargetFacts
    embed: np.ndarray
    lm_head: np.ndarray


def target_for_head(path: Path) -> TargetForHead:
    """Read a GGUF for a head."""
    facts = read_facts(path)
    embed, lm_head = read_embeddings(path)
    return TargetForHead(facts, embed, lm_head)
