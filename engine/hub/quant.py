"""Quantization types and shard groups, read from GGUF file names."""

from __future__ import annotations

import re
from dataclasses import dataclass

# A quant tag stands between separators: "Llama-3.2-1B-Q4_K_M.gguf", "model.IQ3_XS.gguf",
# "smollm2-135m-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct-fp16.gguf".
_QUANT = re.compile(
    r"(?:^|[-._])((?:IQ|TQ|Q)\d(?:_[A-Z0-9]+)*|BF16|FP16|FP32|F16|F32|MXFP4)(?=[-.]|$)",
    re.IGNORECASE,
)
# llama.cpp's gguf-split names: "<stem>-00001-of-00003.gguf".
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$", re.IGNORECASE)

# Approximate bits per weight, only to sort and describe; sizes come from the Hub.
BITS_PER_WEIGHT: dict[str, float] = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.69,
    "Q5_K_S": 5.54, "Q5_1": 6.0, "Q5_0": 5.5, "Q4_K_M": 4.89, "Q4_K_S": 4.58, "Q4_1": 5.0,
    "Q4_0": 4.5, "IQ4_XS": 4.25, "IQ4_NL": 4.5, "Q3_K_L": 4.27, "Q3_K_M": 3.91,
    "Q3_K_S": 3.5, "IQ3_M": 3.7, "IQ3_XS": 3.3, "Q2_K": 3.35, "IQ2_M": 2.7, "IQ2_XS": 2.31,
    "IQ1_M": 1.75, "IQ1_S": 1.56,
}


def parse_quant(filename: str) -> str:
    """The quantization tag of a GGUF file name, upper case ("Q4_K_M", "F16"), or
    "unknown" when the name carries none. The last tag wins ("Q8_0-F16" is unusual, but
    the weights' tag is conventionally the last)."""
    name = filename.rsplit("/", 1)[-1]
    found = _QUANT.findall(name)
    if not found:
        return "unknown"
    tag = found[-1].upper()
    return {"FP16": "F16", "FP32": "F32"}.get(tag, tag)


def strip_quant(stem: str) -> str:
    """A GGUF file stem without its quantization tag: "SmolLM2-135M-Instruct.Q4_0" ->
    "SmolLM2-135M-Instruct"."""
    return _QUANT.sub("", stem)


@dataclass(frozen=True)
class Shard:
    """Where one file sits in a split GGUF: ``index`` of ``count`` (1-based)."""

    stem: str
    index: int
    count: int


def parse_shard(filename: str) -> Shard | None:
    """The shard position of a split GGUF name, or None for a single-file model."""
    m = _SHARD.match(filename)
    if m is None:
        return None
    return Shard(m["stem"], int(m["i"]), int(m["n"]))


def group_shards(filenames: list[str]) -> list[list[str]]:
    """GGUF file names grouped into models: a single file alone, a split model's shards
    together in index order. A split model missing shards is left out (it cannot load).
    Groups keep the order of their first file."""
    groups: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    for name in filenames:
        # Vision projectors ship as GGUF beside the model but are not language models.
        if not name.lower().endswith(".gguf") or name.rsplit("/", 1)[-1].startswith("mmproj"):
            continue
        shard = parse_shard(name)
        key = name if shard is None else f"{shard.stem}\0{shard.count}"
        groups.setdefault(key, []).append(name)
        counts[key] = 1 if shard is None else shard.count
    out = []
    for key, names in groups.items():
        if len(names) != counts[key]:
            continue
        out.append(sorted(names))
    return out
