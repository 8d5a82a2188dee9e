"""Whether a local GGUF can run at all, and if not, why in one clause: cut short,
unreadable, or missing the weights its architecture needs. Import refuses such a file
up front; a load that llama.cpp refuses is explained with the same words."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError
from engine.gguf.header import check_gguf_magic, tensor_data_end


def check_gguf(path: Path) -> dict[str, object]:
    """Validate a local GGUF: the magic bytes, its length against the header's tensors,
    a full header read with the ``gguf`` package, the weights. Returns a few header facts
    (architecture, tensor count). Raises ModelLoadError naming what is wrong."""
    check_gguf_magic(path)
    problem, facts = _inspect(Path(path))
    if problem:
        raise ModelLoadError(f"{path}: {problem}")
    return facts


def why_unloadable(path: Path) -> str | None:
    """The reason a GGUF cannot run, or None when none is found here."""
    try:
        check_gguf_magic(path)
    except ModelLoadError as exc:
        return str(exc)
    return _inspect(Path(path))[0]


def _inspect(path: Path) -> tuple[str | None, dict[str, object]]:
    truncated = _truncation(path)
    if truncated:
        return truncated, {}
    try:
        import gguf

        reader = gguf.GGUFReader(path)
        field_ = reader.fields.get("general.architecture")
        arch = bytes(field_.parts[-1]).decode() if field_ is not None else "unknown"
        blocks = reader.fields.get(f"{arch}.block_count")
        n_blocks = int(blocks.parts[-1][0]) if blocks is not None else 0
        names = {t.name for t in reader.tensors}
    except Exception as exc:  # noqa: BLE001 - any reader failure means an unusable file
        return f"it has a GGUF magic but its header cannot be read ({exc})", {}
    return _missing_weights(names, n_blocks), {"architecture": arch, "n_tensors": len(names)}


def _missing_weights(names: set[str], n_blocks: int) -> str | None:
    """A GGUF that cannot run: no tensors at all (a vocabulary-only file, as llama.cpp's
    tests and tokenizers ship), no token embedding, or layers without weights."""
    if not names:
        return "it holds no weights (a vocabulary-only GGUF): it can tokenize but never run"
    if "token_embd.weight" not in names:
        return "it has no token embedding (token_embd.weight): not a complete model"
    empty = [i for i in range(n_blocks) if not any(n.startswith(f"blk.{i}.") for n in names)]
    if empty:
        return (f"it declares {n_blocks} layers but has no weights for {len(empty)} of them "
                f"(first: layer {empty[0]})")
    return None


def _truncation(path: Path) -> str | None:
    end, size = tensor_data_end(path), path.stat().st_size
    if end is None or size >= end:
        return None
    return (f"the file is truncated: it has {size:,} bytes but its tensors end at byte "
            f"{end:,} (an interrupted download or copy?); download or copy it again")
