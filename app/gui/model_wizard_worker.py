"""The model wizard's lane to the Hub: a QObject living in a QThread.

The dialog sends requests by signal (queued into this thread) and receives results and
failures by signal; failures cross as ``HubFailure`` values. Pause and cancel are direct
calls on the shared DownloadControl, because a queued signal would only arrive after the
download it means to stop."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from engine.errors import DownloadCancelledError, TandemError
from engine.hub.catalog import HeadChoice, HeadPair, matching_heads
from engine.hub.download import DownloadControl, Downloader, DownloadProgress
from engine.hub.fit import FitEstimate, MachineMemory, estimate_fit, machine_memory
from engine.hub.install import install
from engine.hub.local_models import ModelRegistry
from engine.hub.search import GGUFChoice, list_repo, read_remote_facts, search_gguf

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubFailure:
    """A failed request: ``what`` it was ("search", "list", "download") and the message."""

    what: str
    message: str
    cancelled: bool = False


@dataclass(frozen=True)
class RepoDetails:
    """One repository's models with their fit, and the draft heads that go with it."""

    repo_id: str
    n_ctx: int
    rows: tuple[tuple[GGUFChoice, FitEstimate], ...]
    heads: tuple[HeadChoice, ...]


@dataclass(frozen=True)
class DownloadRequest:
    """A job; the dialog keeps ``control`` to pause and cancel it."""

    choice: GGUFChoice
    head: HeadChoice | None
    control: DownloadControl


class HubWorker(QObject):
    """Runs searches, listings and downloads, one at a time, off the UI thread."""

    searched = Signal(object)  # list[RepoHit]
    listed = Signal(object)  # RepoDetails
    progress = Signal(object)  # DownloadProgress
    installed = Signal(object)  # LocalModel
    failed = Signal(object)  # HubFailure

    def __init__(self, endpoint: str | None, cache_dir: Path | None, registry: ModelRegistry,
                 catalog: tuple[HeadPair, ...], memory: MachineMemory | None = None) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.cache_dir = cache_dir
        self.registry = registry
        self.catalog = catalog
        self._memory = memory

    @Slot(str)
    def search(self, query: str) -> None:
        try:
            self.searched.emit(search_gguf(query, endpoint=self.endpoint))
        except TandemError as exc:
            self.failed.emit(HubFailure("search", str(exc)))
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the dialog waiting
            log.exception("search failed")
            self.failed.emit(HubFailure("search", f"unexpected error: {exc}"))

    @Slot(str, int)
    def list_repo(self, repo_id: str, n_ctx: int) -> None:
        try:
            choices = list_repo(repo_id, endpoint=self.endpoint).gguf_choices()
            facts = read_remote_facts(choices[0], endpoint=self.endpoint) if choices else None
            heads = matching_heads(repo_id, facts, catalog=self.catalog,
                                   endpoint=self.endpoint)
            if self._memory is None:
                self._memory = machine_memory()
            n_head = heads[0].n_bytes if heads else 0
            rows = tuple((c, estimate_fit(c.n_bytes, n_head, n_ctx, facts, self._memory))
                         for c in choices)
            self.listed.emit(RepoDetails(repo_id, n_ctx, rows, tuple(heads)))
        except TandemError as exc:
            self.failed.emit(HubFailure("list", str(exc)))
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the dialog waiting
            log.exception("listing %s failed", repo_id)
            self.failed.emit(HubFailure("list", f"unexpected error: {exc}"))

    @Slot(object)
    def download(self, request: DownloadRequest) -> None:
        downloader = Downloader(self.cache_dir, self.endpoint)
        try:
            model, _ = install(request.choice, request.head, downloader, self.registry,
                               control=request.control, on_progress=self._report)
            self.installed.emit(model)
        except DownloadCancelledError as exc:
            self.failed.emit(HubFailure("download", str(exc), cancelled=True))
        except TandemError as exc:
            self.failed.emit(HubFailure("download", str(exc)))
        except OSError as exc:  # the cache directory itself (permissions, full disk)
            self.failed.emit(HubFailure("download", f"cannot write the model: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the dialog busy
            log.exception("download failed")
            self.failed.emit(HubFailure("download", f"unexpected error: {exc}"))

    def _report(self, p: DownloadProgress) -> None:
        self.progress.emit(p)
