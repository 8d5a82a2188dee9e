"""The huggingface_hub cache layout, so files Tandem downloads are found by other tools
(``hf_hub_download(..., local_files_only=True)``) and the other way round::

    <cache>/models--owner--name/blobs/<etag>                 the content (sha256 for LFS)
    <cache>/models--owner--name/blobs/<etag>.incomplete      a partial download
    <cache>/models--owner--name/snapshots/<commit>/<file>    relative symlink to the blob
    <cache>/models--owner--name/refs/main                    the commit "main" points to
    <cache>/.locks/models--owner--name/<etag>.lock           held while writing a blob
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """huggingface_hub's cache (HF_HUB_CACHE / HF_HOME aware)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


@dataclass(frozen=True)
class RepoCache:
    """Paths of one model repository inside a cache directory."""

    cache_dir: Path
    repo_id: str

    @property
    def root(self) -> Path:
        return self.cache_dir / repo_folder_name(self.repo_id)

    def blob(self, etag: str) -> Path:
        return self.root / "blobs" / etag

    def incomplete(self, etag: str) -> Path:
        return self.root / "blobs" / f"{etag}.incomplete"

    def lock(self, etag: str) -> Path:
        return self.cache_dir / ".locks" / repo_folder_name(self.repo_id) / f"{etag}.lock"

    def snapshot(self, commit: str, filename: str) -> Path:
        return self.root / "snapshots" / commit / filename

    def ref(self, revision: str) -> Path:
        return self.root / "refs" / revision

    def link_snapshot(self, etag: str, commit: str, filename: str) -> Path:
        """Point ``snapshots/<commit>/<filename>`` at the blob (relative symlink, or a
        copy where the file system has no symlinks) and return the snapshot path."""
        blob, dst = self.blob(etag), self.snapshot(commit, filename)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        try:
            dst.symlink_to(os.path.relpath(blob, dst.parent))
        except OSError:  # Windows without developer mode, some network shares
            shutil.copyfile(blob, dst)
        return dst

    def write_ref(self, revision: str, commit: str) -> None:
        """Record that ``revision`` (a branch or tag) resolved to ``commit``; a commit
        hash needs no ref."""
        if revision == commit:
            return
        path = self.ref(revision)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(commit)
        os.replace(tmp, path)

    def remove_snapshot_file(self, commit: str, filename: str) -> None:
        """Delete one snapshot file and its blob when no other snapshot links to it."""
        snap = self.snapshot(commit, filename)
        blob = snap.resolve() if snap.is_symlink() else None
        if snap.is_symlink() or snap.exists():
            snap.unlink()
        if blob is None or not blob.exists():
            return
        snapshots = self.root / "snapshots"
        for other in snapshots.rglob("*"):
            if other.is_symlink() and other.resolve() == blob:
                return
        blob.unlink()
        log.info("removed %s", blob)


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the disk that holds ``path`` (or its nearest existing parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free
