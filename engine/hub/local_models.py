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

from engine.gguf.check import check_gguf
from engine.hub.quant import parse_quant

log = logging.getLogger(__name__)

REGISTRY_FILE = "models.json"


def default_registry_path() -> Path:
    """``<Tandem data dir>/models/models.json``. Same rule as engine.hub.model_store.data_dir,
    repeated here because importing that module loads llama.cpp."""
    import platformdirs

    env = os.environ.get("TANDEM_HOME")
    home = Path(env) if env else Path(platformdirs.user_data_dir("tandem", appauthor=False))
    return home / "models" / REGISTRY_FILE


@dataclass(frozen=True)
class LocalModel:
    """One usable model. ``path`` is the GGUF given to llama.cpp (the first shard of a
    split model); ``head_dir`` holds head.json + head.safetensors when a draft head came
    with it; ``draft_path`` is the draft model paired with it (downloaded with it from
    ``draft_repo``, or a GGUF that was already here when ``draft_repo`` is None)."""

    name: str
    path: str
    source: str  # "hub", "import" or "convert" (a file Tandem wrote from another model)
    n_bytes: int
    quant: str
    repo_id: str | None = None
    commit: str | None = None
    files: tuple[str, ...] = ()
    head_dir: str | None = None
    head_repo: str | None = None
    head_commit: str | None = None
    added: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))
    # Fields added later default to None, so older models.json files read unchanged.
    draft_path: str | None = None
    draft_repo: str | None = None
    draft_commit: str | None = None
    draft_files: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        return Path(self.path).is_file()

    @property
    def draft_label(self) -> str:
        """The paired draft in words: its repository and file, or its file name."""
        if self.draft_path is None:
            return "-"
        name = Path(self.draft_path).name
        return f"{self.draft_repo}/{name}" if self.draft_repo else name


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
            return [LocalModel(**{**r, "files": tuple(r.get("files", ())),
                                  "draft_files": tuple(r.get("draft_files", ()))})
                    for r in rows]
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
        from the cache (blobs no other snapshot uses), or a converted model's file.
        Imported files are never deleted: Tandem did not make them. Raises KeyError."""
        model = self.get(name)
        remaining = [m for m in self.list() if m.name != name]
        self._write(remaining)
        # A file may serve several models (Llama 3.2 1B as a model and as the draft of
        # 8B and 70B): it goes only when no other registered model names it.
        in_use = {p for m in remaining for p in (m.path, m.draft_path) if p}
        if delete_files and model.source == "convert" and model.path not in in_use:
            Path(model.path).unlink(missing_ok=True)
        if delete_files and model.source == "hub" and model.repo_id and model.commit:
            from engine.hub.cache_layout import RepoCache, default_cache_dir

            cache = RepoCache(cache_dir or default_cache_dir(), model.repo_id)
            if model.path not in in_use:
                for filename in model.files:
                    cache.remove_snapshot_file(model.commit, filename)
            if model.draft_repo and model.draft_commit and model.draft_path not in in_use:
                draft_cache = RepoCache(cache_dir or default_cache_dir(), model.draft_repo)
                for filename in model.draft_files:
                    draft_cache.remove_snapshot_file(model.draft_commit, filename)
        return model

    def _write(self, rows: list[LocalModel]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps([asdict(m) for m in rows], indent=2))
        os.replace(tmp, self.path)


def import_gguf(path: Path, registry: ModelRegistry, name: str | None = None) -> LocalModel:
    """Register a GGUF file where it lies (it is not copied). Raises ModelLoadError when
    it is not a readable GGUF."""
    path = Path(path).resolve()
    check_gguf(path)
    model = LocalModel(name=name or path.stem, path=str(path), source="import",
                       n_bytes=path.stat().st_size, quant=parse_quant(path.name))
    return registry.add(model)
