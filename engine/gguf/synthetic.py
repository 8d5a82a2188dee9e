"""GGUF files with the exact matrices of a real model and random weights, for measuring.

A decode's cost depends on the shapes and the quantization, not on the values, so a file
with Llama 3.1 8B's matrices in Q4_0 costs what the real Q4_0 model costs to verify n
tokens. The tokenizer comes from another GGUF (the bundled model's), so the vocabulary,
the embedding and the LM head have that tokenizer's size; everything else is the real
shape. Weights are random with small scales, so activations stay finite through every
layer (RMS norms reset the scale; a matrix's outputs stay near unit size).

Nothing this writes can say anything sensible: it exists to be timed."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.gguf.model_shapes import ModelShape

# Q4_0: a float16 scale, then 32 4-bit weights (q - 8) * d. With inputs of unit RMS, an
# output of a k-wide row has a spread of about sqrt(k) * 4.6 * d: d = 0.003 keeps a
# 4096-wide row near 1. Q8_0: a float16 scale, then 32 int8 weights (spread ~74 * d).
_BLOCK = {"Q4_0": (18, 0.003), "Q8_0": (34, 0.0002)}
_POOL_BYTES = 64 << 20  # random bytes reused for every tensor: values do not matter


def _random_pool(qtype: str, rng: np.random.Generator) -> np.ndarray:
    size, scale = _BLOCK[qtype]
    blocks = rng.integers(0, 256, (_POOL_BYTES // size, size), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return blocks.reshape(-1)


def _tensor_plan(shape: ModelShape, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape (rows = outputs), type) of every tensor llama.cpp loads."""
    d, kv, ff = shape.hidden_size, shape.n_kv_heads * shape.head_dim, shape.ffn_size
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (n_vocab, d), "Q4_0"),
                                                   ("output_norm.weight", (d,), "F32")]
    if not shape.tied_embeddings:
        # llama.cpp's quantizer keeps the LM head at higher precision (Q6_K in a Q4_0 file):
        # Q8_0 is close in bytes read per token.
        out.append(("output.weight", (n_vocab, d), "Q8_0"))
    for i in range(shape.n_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,), "F32"),
                (b + "attn_q.weight", (d, d), "Q4_0"),
                (b + "attn_k.weight", (kv, d), "Q4_0"),
                (b + "attn_v.weight", (kv, d), "Q4_0"),
                (b + "attn_output.weight", (d, d), "Q4_0"),
                (b + "ffn_norm.weight", (d,), "F32"),
                (b + "ffn_gate.weight", (ff, d), "Q4_0"),
                (b + "ffn_up.weight", (ff, d), "Q4_0"),
                (b + "ffn_down.weight", (d, ff), "Q4_0")]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (d,), "F32"), (b + "attn_k.bias", (kv,), "F32"),
                    (b + "attn_v.bias", (kv,), "F32")]
    return out


# key -> (value, GGUF value type, array item type or None)
Fields = dict[str, tuple[object, int, int | None]]


def tokenizer_fields(source: Path) -> Fields:
    """Every ``tokenizer.*`` key of the GGUF ``source`` with its value and types (read
    once per file version: parsing a 49k-token vocabulary takes seconds); a copy the
    caller may edit."""
    stat = Path(source).stat()
    fields = _tokenizer_fields(Path(source).resolve(), stat.st_mtime_ns, stat.st_size)
    return {key: (list(value) if isinstance(value, list) else value, vtype, sub)
            for key, (value, vtype, sub) in fields.items()}


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source: Path, _mtime_ns: int, _size: int) -> Fields:
    from gguf import GGUFReader

    return _fields_of(GGUFReader(str(source)), "tokenizer.")


def _fields_of(reader, prefix: str) -> Fields:  # noqa: ANN001
    """The keys of ``reader`` (a GGUFReader) that start with ``prefix``, with values and
    types."""
    from gguf import GGUFValueType

    out: Fields = {}
    for key, field in reader.fields.items():
        if not key.startswith(prefix) or key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                value: object = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i][0].item() for i in field.data]
            out[key] = (value, vtype, sub)
        elif vtype == GGUFValueType.STRING:
            out[key] = (bytes(field.parts[field.data[0]]).decode(), vtype, None)
        else:
            out[key] = (field.parts[field.data[0]][0].item(), vtype, None)
    return out


def copy_with_chat_template(source: Path, path: Path, template: str) -> Path:
    """Write ``path``: ``source`` with ``template`` as its chat template, every other
    key and every tensor as they are (a model as another family's template would
    serve it: tool syntaxes, reasoning switches)."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(source))
    fields = _fields_of(reader, "")
    arch = fields.pop("general.architecture")[0]
    writer = GGUFWriter(str(path), str(arch))
    fields.pop("general.alignment", None)  # the writer writes its own
    for key, (value, vtype, sub) in fields.items():
        if key != "tokenizer.chat_template":
            writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_chat_template(template)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def copy_tokenizer(writer, source: Path, skip: tuple[str, ...] = (),  # noqa: ANN001
                   n_vocab: int | None = None) -> int:
    """Copy every ``tokenizer.*`` key of ``source`` but ``skip`` into ``writer``; returns
    its vocabulary size. ``n_vocab`` pads the vocabulary with unused tokens to that size
    (a 262k-token model's logits row, with a tokenizer that never makes those tokens)."""
    fields = tokenizer_fields(source)
    if n_vocab is not None:
        _pad_vocabulary(fields, n_vocab)
    for key, (value, vtype, sub) in fields.items():
        if key not in skip:
            writer.add_key_value(key, value, vtype, sub_type=sub)
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens to copy")
    return len(tokens[0])  # type: ignore[arg-type]


def _pad_vocabulary(fields: Fields, n_vocab: int) -> None:
    tokens = fields["tokenizer.ggml.tokens"][0]
    assert isinstance(tokens, list)
    n_have = len(tokens)
    if n_vocab < n_have:
        raise ValueError(f"cannot shrink a vocabulary of {n_have} tokens to {n_vocab}")
    tokens += [f"<unused{i}>".encode() for i in range(n_vocab - n_have)]
    for key, pad in (("tokenizer.ggml.token_type", 5), ("tokenizer.ggml.scores", 0.0)):
        if key in fields:  # 5: unused, as the vocabularies that have such tokens mark them
            values = fields[key][0]
            assert isinstance(values, list)
            values += [pad] * (n_vocab - n_have)


def write_synthetic_gguf(shape: ModelShape, path: Path, tokenizer_from: Path,
                         seed: int = 0, progress: Callable[[int, int], None] | None = None,
                         weights: str = "Q4_0") -> Path:
    """Write ``path``: ``shape``'s matrices with random weights, the tokenizer of
    ``tokenizer_from``. ``weights``: "Q4_0" (cheap to write, for timing) or "F32" (normal
    weights of unit-preserving scale, to requantize to any type with llama.cpp's
    quantize). ``progress(bytes written, total)`` is called per tensor."""
    if weights not in ("Q4_0", "F32"):
        raise ValueError(f"weights must be Q4_0 or F32, not {weights!r}")
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = shape.architecture
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"{shape.name} (synthetic: random weights, for timing)")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.ffn_size)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(2 if weights == "Q4_0" else 0)  # mostly Q4_0, or all F32
    n_vocab = copy_tokenizer(writer, tokenizer_from)
    writer.add_vocab_size(n_vocab)
    plan = _tensor_plan(shape, n_vocab)
    if weights == "F32":
        plan = [(name, dims, "F32") for name, dims, _ in plan]
    pools = {q: _random_pool(q, rng) for q in _BLOCK}
    sizes = []
    for name, dims, qtype in plan:
        if qtype == "F32":
            nbytes = 4 * int(np.prod(dims))
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes)
        else:
            block = _BLOCK[qtype][0]
            row_bytes = dims[1] // 32 * block
            nbytes = dims[0] * row_bytes
            writer.add_tensor_info(name, (dims[0], row_bytes), np.dtype(np.uint8), nbytes,
                                   raw_dtype=GGMLQuantizationType[qtype])
        sizes.append(nbytes)
    total, done = sum(sizes), 0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (name, dims, qtype), nbytes in zip(plan, sizes, strict=True):
        if qtype == "F32" and len(dims) == 2:
            # A matrix whose outputs keep unit size: normal, scaled by 1/sqrt(inputs).
            scale = 1.0 / np.sqrt(dims[1])
            writer.write_tensor_data((rng.standard_normal(dims, np.float32) * scale)
                                     .astype(np.float32))
        elif qtype == "F32":
            # Norm weights 1, biases small: the layer keeps its scale.
            value = 0.01 if name.endswith(".bias") else 1.0
            writer.write_tensor_data(np.full(dims, value, np.float32))
        else:
            pool = pools[qtype]
            block = _BLOCK[qtype][0]
            start = int(rng.integers(0, (len(pool) - min(nbytes, len(pool))) // block + 1)) * block
            data = np.resize(pool[start:], nbytes) if nbytes > len(pool) - start \
                else pool[start:start + nbytes]
            writer.write_tensor_data(data)
        done += nbytes
        if progress is not None:
            progress(done, total)
    writer.close()
    return path
