"""Small GGUFs that carry a real model's tokenizer: the bundled SmolLM2 vocabulary (or
an edited copy of it) in front of a few tiny tensors. Enough for header reads, vocabulary
checks, sizes and downloads; never meant to generate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.gguf.synthetic import Fields, tokenizer_fields


def write_vocab_gguf(path: Path, tokenizer_from: Path, *, name: str = "Tiny SmolLM2",
                     n_extra_bytes: int = 0, architecture: str = "llama",
                     edit: Callable[[Fields], None] | None = None) -> Path:
    """A llama-shaped GGUF with ``tokenizer_from``'s tokenizer (``edit`` may change the
    fields first), padded with a tensor of ``n_extra_bytes``."""
    import gguf
    import numpy as np

    fields = tokenizer_fields(tokenizer_from)
    if edit is not None:
        edit(fields)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name(name)
    w.add_block_count(2)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    for key, (value, vtype, sub) in fields.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    if n_extra_bytes:
        w.add_tensor("extra.weight", np.zeros((1, max(1, n_extra_bytes // 4)), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def other_vocab(fields: Fields) -> None:
    """Edit: a SentencePiece tokenizer whose token texts differ from id 100 on."""
    from gguf import GGUFValueType

    tokens = list(fields["tokenizer.ggml.tokens"][0])  # type: ignore[arg-type]
    tokens[100:] = [b"x" + t for t in tokens[100:]]
    fields["tokenizer.ggml.tokens"] = (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    fields["tokenizer.ggml.model"] = ("llama", GGUFValueType.STRING, None)
    fields.pop("tokenizer.ggml.merges", None)
    fields.pop("tokenizer.ggml.pre", None)
