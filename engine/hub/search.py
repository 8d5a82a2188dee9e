"""Finding GGUF models on the Hub: repositories, their quantized files, their shapes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.gguf.header import GGUFFacts, read_facts_prefix
from engine.hub.quant import BITS_PER_WEIGHT, group_shards, parse_quant
from engine.hub.remote import call_api, fetch_prefix, make_api, resolve_url
from engine.runtime.template_choice import name_says_base

log = logging.getLogger(__name__)

# The architecture keys come first in a GGUF; the tokenizer arrays after them are long.
HEADER_PREFIX_BYTES = 512 * 1024


@dataclass(frozen=True)
class RepoHit:
    """One search result."""

    repo_id: str
    n_downloads: int
    n_likes: int

    @property
    def base_model(self) -> bool:
        """The name says base (it continues text rather than answering)."""
        return name_says_base(self.repo_id) is True


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repository at a commit, with what the Hub reports to verify it."""

    filename: str
    n_bytes: int
    sha256: str | None  # LFS files: the content's sha256
    blob_id: str | None  # git blob sha1 (the etag of a non-LFS file)

    @property
    def etag(self) -> str:
        """The name the huggingface_hub cache gives the blob: sha256 for LFS files,
        the git blob id otherwise."""
        return self.sha256 or self.blob_id or ""


@dataclass(frozen=True)
class GGUFChoice:
    """One model in a repository: a quantization, as one file or split shards."""

    repo_id: str
    commit: str
    quant: str
    files: tuple[RemoteFile, ...]

    @property
    def name(self) -> str:
        """The first (or only) file: the one llama.cpp is given."""
        return self.files[0].filename

    @property
    def n_bytes(self) -> int:
        return sum(f.n_bytes for f in self.files)


@dataclass(frozen=True)
class RepoListing:
    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]

    def gguf_choices(self) -> list[GGUFChoice]:
        """The GGUF models of the repository, smallest first."""
        by_name = {f.filename: f for f in self.files}
        out = [GGUFChoice(self.repo_id, self.commit, parse_quant(names[0]),
                          tuple(by_name[n] for n in names))
               for names in group_shards([f.filename for f in self.files])]
        return sorted(out, key=lambda c: (c.n_bytes, -BITS_PER_WEIGHT.get(c.quant, 0)))

    def file(self, filename: str) -> RemoteFile:
        """The file named ``filename``. Raises KeyError."""
        for f in self.files:
            if f.filename == filename:
                return f
        raise KeyError(f"{self.repo_id} has no file {filename!r}")


def search_gguf(query: str, *, limit: int = 20, endpoint: str | None = None,
                token: str | bool | None = None) -> list[RepoHit]:
    """GGUF repositories matching ``query``, most downloaded first. Raises
    NetworkUnavailableError or HubServerError."""
    api = make_api(endpoint, token)

    def run() -> list[RepoHit]:
        models = api.list_models(search=query or None, filter="gguf", sort="downloads",
                                 limit=limit)
        hits = [RepoHit(m.id, int(m.downloads or 0), int(m.likes or 0)) for m in models]
        # A chat app wants instruct models: base ones after them, each kept by downloads.
        return sorted(hits, key=lambda h: h.base_model)

    return call_api(run, f"searching the Hub for {query!r}")


def list_repo(repo_id: str, *, revision: str | None = None, endpoint: str | None = None,
              token: str | bool | None = None) -> RepoListing:
    """Every file of ``repo_id`` at ``revision`` (default: main) with sizes and hashes,
    pinned to the commit the Hub resolved. Raises NetworkUnavailableError or
    HubServerError."""
    api = make_api(endpoint, token)
    info = call_api(lambda: api.model_info(repo_id, revision=revision, files_metadata=True),
                    f"listing {repo_id}")
    files = []
    for s in info.siblings or []:
        sha256 = s.lfs.sha256 if s.lfs is not None else None
        size = s.lfs.size if s.lfs is not None else s.size
        files.append(RemoteFile(s.rfilename, int(size or 0), sha256, s.blob_id))
    return RepoListing(repo_id, str(info.sha), tuple(files))


def read_remote_facts(choice: GGUFChoice, *, endpoint: str | None = None) -> GGUFFacts | None:
    """The shape facts from the start of a remote GGUF (one ranged request), or None when
    they cannot be read: the fit then falls back to the size-based estimate."""
    url = resolve_url(choice.repo_id, choice.name, choice.commit, endpoint)
    try:
        return read_facts_prefix(fetch_prefix(url, HEADER_PREFIX_BYTES))
    except Exception as exc:  # noqa: BLE001 - the fit has a fallback; say why in the log
        log.info("no header facts for %s/%s: %s", choice.repo_id, choice.name, exc)
        return None
