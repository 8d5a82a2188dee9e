"""A GGUF at another weight type: F32, F16, BF16, Q8_0 or Q4_0, with llama.cpp's quantize.

Why a user wants it: a float target verifies a batch of drafted tokens for little more
than one token costs (it is memory-bound), so the same model in F16 or F32 is where
drafts pay most; and many downloaded models are F16 already. Converting a quantized file
up cannot restore precision: the weights are the quantized ones, written at the new
type (the same answers' model, at float speed).

The new file is written beside the name it will have, as ``NAME.part``, and renamed only
once llama.cpp finished and its header reads back: a failed or interrupted conversion
never leaves a file that looks like a model.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from engine.errors import TandemError
from engine.gguf.check import check_gguf
from engine.gguf.importance import flat_importance, needs_importance
from engine.hub.cache_layout import free_disk_bytes
from engine.hub.fit import human_bytes
from engine.hub.quant import strip_quant
from engine.runtime.native import FTYPES, ftype_named, quantize

BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
CONVERT_TYPES = tuple(BYTES_PER_WEIGHT)
_HEADER_ALLOWANCE = 8 << 20  # vocabulary and metadata, copied as they are


class ConvertError(TandemError, ValueError):
    """A conversion that cannot be done: an unknown type, no room on the disk, or the
    file would replace its own source."""


def check_type(to_type: str) -> int:
    """llama.cpp's file type for ``to_type``. Raises ConvertError naming the choices."""
    if to_type not in CONVERT_TYPES:
        raise ConvertError(f"cannot convert to {to_type!r}: choose one of "
                           f"{', '.join(CONVERT_TYPES)}")
    return FTYPES[to_type]


def weight_count(path: Path) -> int:
    """Weights in a GGUF, from its tensor table (no weights are read)."""
    from engine.gguf.header import read_tensor_infos

    table = read_tensor_infos(path)
    if table is None:
        raise ValueError(f"{path}: the GGUF's tensor table cannot be read")
    return sum(t.n_elements for t in table[1])


def estimated_size(path: Path, to_type: str) -> int:
    """Bytes the converted file takes, about (every tensor at the new type)."""
    return int(weight_count(path) * BYTES_PER_WEIGHT[to_type]) + _HEADER_ALLOWANCE


def converted_path(src: Path, to_type: str, out_dir: Path) -> Path:
    """``out_dir/<name without its quantization>.<TYPE>.gguf``."""
    return Path(out_dir) / f"{strip_quant(Path(src).stem)}.{to_type.upper()}.gguf"


def convert(src: Path, dst: Path, to_type: str, n_threads: int,
            progress: Callable[[int, int], None] | None = None,
            free_bytes: int | None = None) -> Path:
    """Write ``src``'s weights to ``dst`` at ``to_type``. ``progress(bytes written,
    bytes expected)`` is called while llama.cpp works. ``free_bytes`` overrides the disk's
    free space (for tests). Raises ConvertError, ModelLoadError (``src`` is not a usable
    GGUF) or NativeError (llama.cpp refused); nothing is left at ``dst`` on failure."""
    ftype = check_type(to_type)
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if src == dst:
        raise ConvertError(f"{dst} is the source itself; choose another output name")
    check_gguf(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    need = estimated_size(src, to_type)
    free = free_disk_bytes(dst.parent) if free_bytes is None else free_bytes
    if need > free:
        raise ConvertError(f"converting {src.name} to {to_type.upper()} needs about "
                           f"{human_bytes(need)} in {dst.parent}, which has "
                           f"{human_bytes(free)} free")
    part = dst.with_name(dst.name + ".part")
    failure: list[BaseException] = []

    def work() -> None:
        try:
            quantize(src, part, ftype, n_threads)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=work, name="convert", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
            if progress is not None:
                progress(_size(part), need)
        if failure:
            raise failure[0]
        check_gguf(part)
        os.replace(part, dst)
    finally:
        if worker.is_alive():  # interrupted: llama.cpp finishes the file, then it goes
            worker.join()
        part.unlink(missing_ok=True)
    if progress is not None:
        progress(need, need)
    return dst


def quantize_as(src: Path, dst: Path, type_name: str, n_threads: int,
                vocab_type: str | None = None) -> Path:
    """Requantize ``src`` to any type llama.cpp makes, by name (``q4_k_m``, ``iq2_xxs``,
    ``mxfp4_moe``...), with a flat importance matrix where the type needs one
    (engine.gguf.importance). ``vocab_type`` (a ggml type's name, ``q8_0``) sets the
    embedding and output matrices' type: the i-quants take seconds per million weights,
    which on a tiny model are mostly the vocabulary's. Raises ValueError (an unknown
    name) or NativeError."""
    from gguf import GGMLQuantizationType

    ftype = ftype_named(type_name)
    importance = flat_importance(src) if needs_importance(type_name) else None
    vocab = None if vocab_type is None else GGMLQuantizationType[vocab_type.upper()].value
    quantize(src, dst, ftype, n_threads, importance, vocab)
    return dst


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
