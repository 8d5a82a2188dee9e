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
from engine.hub.catalog import HeadChoice, HeadPair
from engine.hub.download import DownloadControl, Downloader, DownloadProgress
from engine.hub.draft_catalog import KNOWN_DRAFTS, DraftPair
from engine.hub.draft_pairing import DraftOffer
from engine.hub.fit import MachineMemory, machine_memory
from engine.hub.install import install
from engine.hub.local_models import ModelRegistry
from engine.hub.repo_pairing import RepoPairing, pair_repo
from engine.hub.search import GGUFChoice, search_gguf

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubFailure:
    """A failed request: ``what`` it was ("search", "list", "download") and the message."""

    what: str
    message: str
    cancelled: bool = False


# One repository's models, each with its drafts and fit, and the draft heads for it.
RepoDetails = RepoPairing


@dataclass(frozen=True)
class DownloadRequest:
    """A job; the dialog keeps ``control`` to pause and cancel it."""

    choice: GGUFChoice
    head: HeadChoice | None
    control: DownloadControl
    draft: DraftOffer | None = None


class HubWorker(QObject):
    """Runs searches, listings and downloads, one at a time, off the UI thread."""

    searched = Signal(object)  # list[RepoHit]
    listed = Signal(object)  # RepoDetails (RepoPairing)
    progress = Signal(object)  # DownloadProgress
    installed = Signal(object)  # LocalModel
    failed = Signal(object)  # HubFailure

    def __init__(self, endpoint: str | None, cache_dir: Path | None, registry: ModelRegistry,
                 catalog: tuple[HeadPair, ...], memory: MachineMemory | None = None,
                 draft_catalog: tuple[DraftPair, ...] = KNOWN_DRAFTS) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.cache_dir = cache_dir
        self.registry = registry
        self.catalog = catalog
        self.draft_catalog = draft_catalog
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
            if self._memory is None:
                self._memory = machine_memory()
            # Header reads of the target and each paired draft (their vocabularies
            # checked), heads, and this machine's compatible GGUFs: all off the UI thread.
            self.listed.emit(pair_repo(repo_id, n_ctx, self._memory, head_catalog=self.catalog,
                                       draft_catalog=self.draft_catalog,
                                       registry=self.registry, endpoint=self.endpoint))
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
                               control=request.control, on_progress=self._report,
                               draft=request.draft)
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
