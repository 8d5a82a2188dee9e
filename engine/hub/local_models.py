"""The list of models on this machine: downloaded from the Hub or imported from a file.

Only complete, verified files are ever registered: downloads register after their hash
check and atomic move, imports after the GGUF header reads back."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import ModelLoadError
from engine.gguf_header import check_gguf_magic
from engine.hub.quant import parse_quant

log = logging.getLogger(__name__)

REGISTRY_FILE = "models.json"


def default_registry_path() -> Path:
    """``<Tandem data dir>/models/models.json``. Same rule as engine.model_store.data_dir,
    repeated here because importing that module loads llama.cpp."""
    import platformdirs

    env = os.environ.get("TANDEM_HOME")
    home = Path(env) if env else Path(platformdirs.user_data_dir("tandem", appauthor=False))
    return home / "models" / REGISTRY_FILE


@dataclass(frozen=True)
class LocalModel:
    """One usable model. ``path`` is the GGUF given to llama.cpp (the first shard of a
    split model); ``head_dir`` holds head.json + head.safetensors when a draft head came
    with it."""

    name: str
    path: str
    source: str  # "hub" or "import"
    n_bytes: int
    quant: str
    repo_id: str | None = None
    commit: str | None = None
    files: tuple[str, ...] = ()
    head_dir: str | None = None
    head_repo: str | None = None
    head_commit: str | None = None
    added: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    @property
    def available(self) -> bool:
        return Path(self.path).is_file()


class ModelRegistry:
    """The JSON list of local models. Every write replaces the file atomically."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path else default_registry_path()

    def list(self) -> list[LocalModel]:
        """Registered models, oldest first. A damaged file reads as empty (logged)."""
        if not self.path.is_file():
            return []
        try:
            rows = json.loads(self.path.read_text())
            return [LocalModel(**{**r, "files": tuple(r.get("files", ()))}) for r in rows]
        except (ValueError, TypeError) as exc:
            log.warning("cannot read %s: %s", self.path, exc)
            return []

    def get(self, name: str) -> LocalModel:
        """The model called ``name``. Raises KeyError."""
        for m in self.list():
            if m.name == name:
                return m
        raise KeyError(f"no local model named {name!r}")

    def add(self, model: LocalModel) -> LocalModel:
        """Register ``model``, replacing one of the same name."""
        rows = [m for m in self.list() if m.name != model.name] + [model]
        self._write(rows)
        return model

    def remove(self, name: str, delete_files: bool = False, cache_dir: Path | None = None
               ) -> LocalModel:
        """Unregister ``name``; ``delete_files`` also deletes a downloaded model's files
        from the cache (blobs no other snapshot uses). Imported files are never deleted:
        Tandem did not make them. Raises KeyError."""
        model = self.get(name)
        self._write([m for m in self.list() if m.name != name])
        if delete_files and model.source == "hub" and model.repo_id and model.commit:
            from engine.hub.cache_layout import RepoCache, default_cache_dir

            cache = RepoCache(cache_dir or default_cache_dir(), model.repo_id)
            for filename in model.files:
                cache.remove_snapshot_file(model.commit, filename)
        return model

    def _write(self, rows: list[LocalModel]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps([asdict(m) for m in rows], indent=2))
        os.replace(tmp, self.path)


def check_gguf(path: Path) -> dict[str, object]:
    """Validate a local GGUF: the magic bytes, then a full header read with the ``gguf``
    package. Returns a few header facts (architecture, tensor count). Raises
    ModelLoadError naming what is wrong."""
    check_gguf_magic(path)
    try:
        import gguf

        reader = gguf.GGUFReader(path)
        field_ = reader.fields.get("general.architecture")
        arch = bytes(field_.parts[-1]).decode() if field_ is not None else "unknown"
        blocks = reader.fields.get(f"{arch}.block_count")
        n_blocks = int(blocks.parts[-1][0]) if blocks is not None else 0
        names = {t.name for t in reader.tensors}
    except Exception as exc:  # noqa: BLE001 - any reader failure means an unusable file
        raise ModelLoadError(f"{path} has a GGUF magic but its header cannot be read: "
                             f"{exc}") from exc
    check_has_weights(path, names, n_blocks)
    return {"architecture": arch, "n_tensors": len(names)}


def check_has_weights(path: Path, names: set[str], n_blocks: int) -> None:
    """Refuse a GGUF that cannot run: no tensors at all (a vocabulary-only file, as
    llama.cpp's tests and tokenizers ship), no token embedding, or layers without
    weights."""
    if not names:
        raise ModelLoadError(f"{path} holds no weights (a vocabulary-only GGUF): it can "
                             "tokenize but never run as a model")
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path} has no token embedding (token_embd.weight): not a "
                             "complete model")
    empty = [i for i in range(n_blocks) if not any(n.startswith(f"blk.{i}.") for n in names)]
    if empty:
        raise ModelLoadError(f"{path} declares {n_blocks} layers but has no weights for "
                             f"{len(empty)} of them (first: layer {empty[0]})")


def import_gguf(path: Path, registry: ModelRegistry, name: str | None = None) -> LocalModel:
    """Register a GGUF file where it lies (it is not copied). Raises ModelLoadError when
    it is not a readable GGUF."""
    path = Path(path).resolve()
    check_gguf(path)
    model = LocalModel(name=name or path.stem, path=str(path), source="import",
                       n_bytes=path.stat().st_size, quant=parse_quant(path.name))
    return registry.add(model)
