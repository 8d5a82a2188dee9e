"""The architecture numbers at the start of a GGUF, read from a prefix of its bytes.

The Hub serves byte ranges, so the wizard reads the first few hundred KiB of a remote
model (where ``convert_hf_to_gguf`` writes the ``general.*`` and architecture keys)
instead of downloading gigabytes to size its KV cache. The parser is tolerant: a prefix
that ends mid-way (inside the tokenizer arrays, typically) yields what came before."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# GGUF value types: the fixed-size ones by struct code.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
          12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_KEPT = 4096  # longer numeric arrays are skipped (only per-layer ones matter)


class _Truncated(Exception):
    """The prefix ended inside a value; ``partial`` holds the strings of a kept string
    array read before the end."""

    def __init__(self, partial: list[bytes] | None = None) -> None:
        super().__init__()
        self.partial = partial


@dataclass(frozen=True)
class GGUFFacts:
    """What a model's header says about its shape. Fields are None when the header did
    not carry them (or they lay past the bytes that were read)."""

    architecture: str | None
    n_layers: int | None
    hidden_size: int | None
    n_heads: int | None
    n_kv_heads: int | None
    head_dim_k: int | None
    head_dim_v: int | None
    context_length: int | None
    vocab_size: int | None
    name: str | None = None
    mtp_layers: int = 0  # next-token (MTP) blocks after the trunk's n_layers
    sliding_window: int = 0  # the windowed layers' span (0: none, or not in the header)

    @property
    def has_kv_shape(self) -> bool:
        """Whether the header gave the numbers the KV cache's size follows from."""
        return None not in (self.n_layers, self.n_kv_heads, self.head_dim_k, self.head_dim_v)


class _Reader:
    def __init__(self, data: bytes, endian: str) -> None:
        self.data, self.pos, self.endian = data, 0, endian

    def take(self, fmt: str):  # noqa: ANN201 - one struct value
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise _Truncated
        (value,) = struct.unpack_from(self.endian + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise _Truncated
        raw = self.data[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_strings: bool = False) -> object:
        """A scalar, a string, or for arrays ("array", count, values or None): long
        numeric arrays and string arrays are skipped (only their length matters here)
        unless ``keep_strings`` asks for a string array's items (as raw bytes)."""
        if vtype in _FIXED:
            return self.take(_FIXED[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _FIXED and count > _MAX_KEPT:
                # Token scores and types: skip by arithmetic, not value by value.
                self.pos += count * struct.calcsize(_FIXED[etype])
                if self.pos > len(self.data):
                    raise _Truncated
                return ("array", count, None)
            if etype == _STRING:
                return ("array", count, self.strings(count, keep_strings))
            return ("array", count, [self.value(etype) for _ in range(count)])
        raise ValueError(f"unknown GGUF value type {vtype}")

    def strings(self, count: int, keep: bool) -> list[bytes] | None:
        """``count`` strings as bytes (None when not kept). One tight loop: a
        vocabulary holds up to ~262k of them (Gemma 3), merges twice that."""
        data, pos, end = self.data, self.pos, len(self.data)
        length = struct.Struct(self.endian + "Q").unpack_from
        out: list[bytes] | None = [] if keep else None
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise _Truncated(out)
            (n,) = length(data, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                raise _Truncated(out)
            if out is not None:
                out.append(bytes(data[pos:pos + n]))
            pos += n
        self.pos = pos
        return out


def check_gguf_magic(path: Path) -> None:
    """Raise ModelLoadError unless ``path`` is a readable file that starts like a GGUF."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF "
                             f"starts with {GGUF_MAGIC!r})")


def read_file_facts(path: Path, n_bytes: int = 1 << 20) -> GGUFFacts:
    """Shape facts of a local GGUF from its first ``n_bytes``. Raises ModelLoadError."""
    check_gguf_magic(path)
    with Path(path).open("rb") as fh:
        try:
            return read_facts_prefix(fh.read(n_bytes))
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc


def is_gguf_prefix(data: bytes) -> bool:
    """Whether bytes start like a GGUF file (the magic)."""
    return data[:4] == GGUF_MAGIC


@dataclass(frozen=True)
class KVSection:
    """The metadata read from a GGUF prefix. ``complete``: every key/value was read (a
    key absent from ``kv`` is absent from the file); otherwise the prefix ended inside
    the value of ``cut_key`` (None: between keys), and later keys are unknown."""

    kv: dict[str, object]
    complete: bool
    cut_key: str | None = None


def read_kv_section(data: bytes, keep_strings: frozenset[str] = frozenset()) -> KVSection:
    """The metadata of a GGUF prefix (``data`` may be bytes or an mmap). String arrays
    named in ``keep_strings`` keep their items as bytes; one the prefix cuts keeps the
    items read so far as ("array", count, partial list). Raises ValueError when the
    bytes are not a GGUF."""
    if not is_gguf_prefix(data):
        raise ValueError("not a GGUF file (the first bytes are not 'GGUF')")
    # Big-endian GGUFs exist (s390x); their version reads as a huge little-endian number.
    endian = "<" if struct.unpack_from("<I", data, 4)[0] < 0x10000 else ">"
    r = _Reader(data, endian)
    r.pos = 4
    out: dict[str, object] = {}
    key: str | None = None
    try:
        version = r.take("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (before 2023)")
        r.take("Q")  # tensor count
        n_kv = r.take("Q")
        for _ in range(n_kv):
            key = None
            key = r.string()
            vtype = r.take("I")
            if vtype == _ARRAY and key in keep_strings:
                start = r.pos
                try:
                    out[key] = r.value(vtype, keep_strings=True)
                except _Truncated as cut:
                    if cut.partial is not None:  # the count was read: keep what came
                        r.pos = start + 4
                        out[key] = ("array", r.take("Q"), cut.partial)
                    raise
            else:
                out[key] = r.value(vtype)
    except _Truncated:
        return KVSection(out, complete=False, cut_key=key)
    return KVSection(out, complete=True)


def read_kv_prefix(data: bytes) -> dict[str, object]:
    """The metadata key/values found in a GGUF prefix (arrays as ("array", n, values)).
    Raises ValueError when the bytes are not a GGUF."""
    return read_kv_section(data).kv


def _int(kv: dict[str, object], key: str) -> int | None:
    v = kv.get(key)
    if isinstance(v, tuple):  # per-layer arrays (e.g. head_count_kv of hybrid models)
        values = [x for x in (v[2] or []) if isinstance(x, int)]
        return max(values) if values else None
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def facts_from_kv(kv: dict[str, object]) -> GGUFFacts:
    """Shape facts from a GGUF's metadata (see :func:`read_kv_prefix`)."""
    arch = kv.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    a = f"{arch}." if arch else "\0"
    hidden = _int(kv, a + "embedding_length")
    n_heads = _int(kv, a + "attention.head_count")
    n_kv = _int(kv, a + "attention.head_count_kv") or n_heads
    default_dim = hidden // n_heads if hidden and n_heads else None
    tokens = kv.get("tokenizer.ggml.tokens")
    vocab = tokens[1] if isinstance(tokens, tuple) else _int(kv, a + "vocab_size")
    name = kv.get("general.name")
    # block_count counts the next-token blocks too; the trunk (and its cache) has the rest.
    mtp_layers = _int(kv, a + "nextn_predict_layers") or 0
    blocks = _int(kv, a + "block_count")
    return GGUFFacts(
        architecture=arch,
        n_layers=blocks - mtp_layers if blocks is not None else None,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim_k=_int(kv, a + "attention.key_length") or default_dim,
        head_dim_v=_int(kv, a + "attention.value_length") or default_dim,
        context_length=_int(kv, a + "context_length"),
        vocab_size=int(vocab) if vocab is not None else None,  # type: ignore[arg-type]
        name=name if isinstance(name, str) else None,
        mtp_layers=mtp_layers,
        sliding_window=_int(kv, a + "attention.sliding_window") or 0,
    )


def read_facts_prefix(data: bytes) -> GGUFFacts:
    """Shape facts from the first bytes of a GGUF. Raises ValueError for non-GGUF bytes."""
    return facts_from_kv(read_kv_prefix(data))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order (the fastest-varying first)
    ggml_type: int
    offset: int  # from the start of the tensor data

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.ggml_type).name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        return self.n_elements // block * type_size


def read_tensor_infos(path: Path, max_header: int = 64 << 20
                      ) -> tuple[int, list[TensorInfo]] | None:
    """(the byte the tensor data starts at, every tensor's name, shape, type and offset)
    of a local GGUF, skipping the vocabulary's values (gguf-py's reader parses all of
    them: seconds for 49k tokens); None when the header cannot be read that far."""
    with Path(path).open("rb") as fh:
        data = fh.read(max_header)
    if not is_gguf_prefix(data):
        return None
    endian = "<" if struct.unpack_from("<I", data, 4)[0] < 0x10000 else ">"
    r = _Reader(data, endian)
    r.pos = 8
    try:
        n_tensors, n_kv = r.take("Q"), r.take("Q")
        alignment = 32
        for _ in range(n_kv):
            key, value = r.string(), r.value(r.take("I"))
            if key == "general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            dims = tuple(r.take("Q") for _ in range(r.take("I")))
            infos.append(TensorInfo(name, dims, r.take("I"), r.take("Q")))
    except (_Truncated, ValueError):
        return None
    return -(-r.pos // alignment) * alignment, infos


def tensor_data_end(path: Path, max_header: int = 64 << 20) -> int | None:
    """The byte a local GGUF's tensor data should end at, from its header (the aligned
    start of the data plus the furthest tensor's end); None when the header cannot be
    read that far."""
    table = read_tensor_infos(path, max_header)
    if table is None:
        return None
    start, infos = table
    try:
        return start + max((t.offset + t.n_bytes for t in infos), default=0)
    except (ValueError, KeyError):  # a type gguf-py does not know
        return None
