"""Write an EAGLE-3 draft head as the ``eagle3`` GGUF llama.cpp loads (docs/eagle3-notes.md).

The head reads three of the target's layer inputs, fused by ``fc`` into one vector, and
runs one decoder layer over [its token's embedding | that vector]. It borrows the target's
token embedding and LM head (llama.cpp's ``ctx_other``), so the file holds only its own
matrices, and the target's tokenizer (llama.cpp sizes the head's logits by it).

``weights`` maps the tensor names below to arrays in torch order ([out, in]); the ones left
out are random (normal, scaled to keep unit size; norms 1), which is what the driver's tests
load before a head is trained.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ModelLoadError
from engine.gguf.header import read_file_facts
from engine.gguf.synthetic import copy_tokenizer

# Weight-matrix types: (general.file_type, what it is).
MATRIX_TYPES = {"f32": (0, "F32"), "f16": (1, "F16"), "q8_0": (7, "Q8_0")}
# The architecture llama.cpp loads an EAGLE-3 head by (its general.architecture).
EAGLE3_ARCHITECTURE = "eagle3"


def is_eagle3_head(path: Path | str) -> bool:
    """Whether ``path`` is an EAGLE-3 head llama.cpp loads: a GGUF whose header names the
    ``eagle3`` architecture. Decided by the header, never the name (a target is a .gguf
    too; a head may be called anything). False for a folder, a missing or unreadable file
    and any other file."""
    try:
        stat = Path(path).stat()
    except OSError:
        return False
    return _eagle3_by_header(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _eagle3_by_header(path: str, mtime_ns: int, size: int) -> bool:
    """Per file version: the GUI asks at every choice, and a header read is not free
    (docs/benchmarks.md: figures behind the code's rules, "Reading GGUF headers")."""
    try:
        return read_file_facts(Path(path)).architecture == EAGLE3_ARCHITECTURE
    except (OSError, ModelLoadError):
        return False


@dataclass(frozen=True)
class Eagle3Shape:
    """The sizes an EAGLE-3 head takes from its target."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    target_layers: tuple[int, int, int]
    target_hidden: int
    context_length: int
    rope_theta: float
    rms_eps: float
    # A reduced draft vocabulary: the head scores these many tokens with its own LM head
    # (``output.weight``), ``d2t`` naming each one's target id; 0 borrows the target's.
    draft_vocab: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> torch-order shape."""
        e, q, kv = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {
            "fc.weight": (e, 3 * self.target_hidden),
            "output_norm.weight": (e,),
            "blk.0.attn_norm.weight": (e,),  # the token embedding's norm
            "blk.0.attn_norm_2.weight": (e,),  # the fused features' norm
            "blk.0.attn_q.weight": (q, 2 * e),
            "blk.0.attn_k.weight": (kv, 2 * e),
            "blk.0.attn_v.weight": (kv, 2 * e),
            "blk.0.attn_output.weight": (e, q),
            "blk.0.ffn_norm.weight": (e,),
            "blk.0.ffn_gate.weight": (self.ffn, e),
            "blk.0.ffn_up.weight": (self.ffn, e),
            "blk.0.ffn_down.weight": (e, self.ffn),
            **({"output.weight": (self.draft_vocab, e), "d2t": (self.draft_vocab,)}
               if self.draft_vocab else {}),
        }


def shape_for_target(target: Path, target_layers: tuple[int, int, int] | None = None
                     ) -> Eagle3Shape:
    """The head shape for a llama-family target GGUF: its width, heads and FFN, and by
    default the layers llama.cpp's converter picks (2, the middle, the fourth from last)."""
    kv = _metadata(Path(target))
    arch = kv.get("general.architecture")

    def key(name: str, default: object = None) -> object:
        value = kv.get(f"{arch}.{name}")
        if isinstance(value, tuple):  # ("array", n, per-layer values)
            value = list(value[2] or [])
        if value is None and default is None:
            raise ValueError(f"{target.name} has no {arch}.{name}")
        return default if value is None else value

    # block_count counts next-token (MTP) blocks too; the head reads the trunk's layers.
    n_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    layers = target_layers or (2, n_layers // 2, n_layers - 3)
    if len(layers) != 3 or not all(0 <= i < n_layers for i in layers):
        raise ValueError(f"three target layers in 0..{n_layers - 1} are needed, got {layers}")
    hidden = int(key("embedding_length"))
    return Eagle3Shape(hidden=hidden, n_heads=_largest(key("attention.head_count")),
                       n_kv_heads=_largest(key("attention.head_count_kv",
                                               key("attention.head_count"))),
                       ffn=_largest(key("feed_forward_length")),
                       target_layers=(int(layers[0]), int(layers[1]), int(layers[2])),
                       target_hidden=hidden, context_length=int(key("context_length")),
                       rope_theta=float(key("rope.freq_base", 10000.0)),
                       rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)))


def write_eagle3_head(path: Path, target: Path, shape: Eagle3Shape | None = None,
                      weights: dict[str, np.ndarray] | None = None, seed: int = 0,
                      n_vocab: int | None = None, matrices: str = "f32",
                      tokenizer_from: Path | None = None) -> Path:
    """Write ``path``: an ``eagle3`` head for ``target`` (its tokenizer copied; ``n_vocab``
    pads it, as another model's vocabulary). ``matrices``: "f32", "f16" or "q8_0" for the
    weight matrices (norms stay F32, as llama.cpp wants them). A reduced vocabulary's
    ``d2t`` holds target ids (the first ``draft_vocab`` ids when not given).
    ``tokenizer_from``: a GGUF with the target's tokenizer to copy it from instead (one
    already read in this process is not parsed again: seconds for 49k tokens). Raises
    ValueError for a weight of the wrong shape, an unknown name or an unknown type."""
    from gguf import GGUFValueType, GGUFWriter

    shape = shape or shape_for_target(Path(target))
    plan = shape.tensors()
    given = dict(weights or {})
    unknown = set(given) - set(plan)
    if unknown:
        raise ValueError(f"not tensors of an eagle3 head: {sorted(unknown)}")
    for name, array in given.items():
        if tuple(array.shape) != plan[name]:
            raise ValueError(f"{name}: shape {tuple(array.shape)}, expected {plan[name]}")
    if matrices not in MATRIX_TYPES:
        raise ValueError(f"matrices must be one of {', '.join(MATRIX_TYPES)}, got {matrices!r}")
    d2t = given.get("d2t")
    if d2t is not None and (len(set(d2t.tolist())) != len(d2t) or d2t.min() < 0
                            or d2t.max() >= (n_vocab or 1 << 62)):
        raise ValueError("d2t must hold distinct target token ids")
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), EAGLE3_ARCHITECTURE)
    writer.add_name("EAGLE-3 draft head")
    # llama.cpp checks the types: lengths and counts u32, norms' epsilon and rope f32.
    writer.add_uint32("eagle3.context_length", shape.context_length)
    writer.add_uint32("eagle3.embedding_length", shape.hidden)
    writer.add_uint32("eagle3.block_count", 1)
    writer.add_uint32("eagle3.feed_forward_length", shape.ffn)
    writer.add_uint32("eagle3.attention.head_count", shape.n_heads)
    writer.add_uint32("eagle3.attention.head_count_kv", shape.n_kv_heads)
    writer.add_float32("eagle3.rope.freq_base", shape.rope_theta)
    writer.add_float32("eagle3.attention.layer_norm_rms_epsilon", shape.rms_eps)
    writer.add_array("eagle3.target_layers", list(shape.target_layers))
    writer.add_uint32("eagle3.target_hidden_size", shape.target_hidden)
    writer.add_key_value("general.file_type", MATRIX_TYPES[matrices][0], GGUFValueType.UINT32)
    copy_tokenizer(writer, Path(tokenizer_from or target), n_vocab=n_vocab)
    for name, dims in plan.items():
        if name == "d2t":
            ids = given.get(name, np.arange(dims[0]))
            writer.add_tensor(name, np.ascontiguousarray(ids, dtype=np.int64))
            continue
        if name in given:
            data = np.ascontiguousarray(given[name], dtype=np.float32)
        elif len(dims) == 1:
            data = np.ones(dims, np.float32)
        else:
            data = (rng.standard_normal(dims, np.float32) / np.sqrt(dims[1])).astype(np.float32)
        _add_matrix(writer, name, data, matrices)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_matrix(writer, name: str, data: np.ndarray, matrices: str) -> None:  # noqa: ANN001
    """Vectors (norms) in F32, matrices in the type asked."""
    from gguf import GGMLQuantizationType, quants

    if data.ndim == 1 or matrices == "f32":
        writer.add_tensor(name, data)
    elif matrices == "f16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        q8 = GGMLQuantizationType.Q8_0
        writer.add_tensor(name, quants.quantize(data, q8), raw_dtype=q8)


def _largest(value: object) -> int:
    """A per-layer value (a list in some architectures, e.g. LFM2's FFN widths): the
    largest, as the head's one layer is shaped like the target's widest."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)  # type: ignore[call-overload]


def _metadata(path: Path) -> dict[str, object]:
    """A GGUF's key/values by Tandem's header reader over the mapped file, which skips
    the vocabulary gguf-py's reader parsed whole, for seconds (docs/benchmarks.md:
    figures behind the code's rules, "Reading GGUF headers")."""
    import mmap

    from engine.gguf.header import read_kv_section

    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return read_kv_section(data).kv
