"""Requantizing a GGUF with llama.cpp, and its file types by name."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path

import llama_cpp
import numpy as np

from engine.errors import NativeError
from engine.runtime.llama_bindings import ensure_backend, log_mark, native_errors_since


def quantize(src: Path, dst: Path, ftype: int, n_threads: int,
             importance: Mapping[str, np.ndarray] | None = None,
             vocab_type: int | None = None) -> None:
    """Requantize a GGUF with llama.cpp (``allow_requantize``). ``importance``: tensor
    name -> one float per input column (times experts), the importance matrix the
    IQ1/IQ2/IQ3_XXS types cannot be made without. ``vocab_type``: a ggml type for the
    token embedding and output matrices instead of the file type's choice. Raises
    NativeError."""
    ensure_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    params.allow_requantize = True
    if vocab_type is not None:
        params.token_embedding_type = params.output_tensor_type = vocab_type
    keep: list[object] = []  # the arrays llama.cpp reads must outlive the call
    if importance:
        entries = (llama_cpp.llama_model_imatrix_data * (len(importance) + 1))()
        for i, (name, values) in enumerate(importance.items()):
            entry = entries[i]  # a view into the array, not a copy
            column = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(column)
            entry.name = name.encode()
            entry.data = column.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = column.size
        params.imatrix = entries  # the last entry's null name ends the list
        keep.append(entries)
    mark = log_mark()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise NativeError("llama_model_quantize", rc, native_errors_since(mark))


# llama.cpp's file types for quantize, by the name Tandem's commands use.
FTYPES = {
    "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
}
FTYPE_Q4_0 = FTYPES["q4_0"]


def ftype_named(name: str) -> int:
    """llama.cpp's file type for any type its quantize makes, by name: ``f32``, ``q4_k_m``,
    ``iq4_nl``, ``mxfp4_moe``... (IQ1/IQ2 and IQ3_XXS also need an importance matrix:
    engine.hub.convert.quantize_as gives one). Raises ValueError naming the known ones."""
    key = name.strip().upper()
    for prefix in ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_"):
        value = getattr(llama_cpp, prefix + key, None)
        if isinstance(value, int):
            return value
    known = sorted(n.split("_", 3)[-1].lower() for n in dir(llama_cpp)
                   if n.startswith(("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")))
    raise ValueError(f"unknown weight type {name!r}; llama.cpp makes {', '.join(known)}")
