"""Downloading a model (target GGUF and its draft head) as one resumable job.

Each file follows a fixed pipeline: metadata (HEAD through huggingface_hub: commit, etag,
size, final URL), a disk-space check for the whole job, a lock, a ``.incomplete`` temp
file, bounded retries that resume with HTTP Range, a size and hash check, and an atomic
move into the cache. A partial file survives errors, pauses, cancels (unless the user
asks otherwise) and restarts: the next run, by any Downloader, resumes from its length.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import (
    ChecksumMismatchError,
    DownloadCancelledError,
    DownloadError,
    NotEnoughDiskError,
)
from engine.hub.cache_layout import RepoCache, default_cache_dir, free_disk_bytes
from engine.hub.remote import is_transient, open_range, resolve_url, typed_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloadItem:
    """One file to fetch: ``etag`` names the blob (sha256 for LFS files, the git blob id
    otherwise) and is what the content is checked against."""

    repo_id: str
    commit: str
    filename: str
    n_bytes: int
    etag: str
    revision: str = "main"  # the ref to record once the file is in the cache


@dataclass(frozen=True)
class DownloadProgress:
    """Where a job stands; ``phase`` is "download", "verify", "paused" or "retry"."""

    filename: str
    index: int
    n_files: int
    n_done: int
    n_total: int
    phase: str
    bytes_per_s: float


@dataclass(frozen=True)
class DownloadResult:
    """A finished job: snapshot paths in job order, and what this run did."""

    paths: tuple[Path, ...]
    n_downloaded: int  # bytes fetched by this run
    n_resumed: int  # bytes of partial files this run continued from
    n_retries: int
    t_total_s: float


class DownloadControl:
    """Pause, resume and cancel a running job from another thread; the downloader
    checks it after every chunk."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused = False
        self._cancelled = False
        self.keep_partial = True

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def cancel(self, keep_partial: bool = True) -> None:
        """Stop the job; ``keep_partial`` keeps the partial files for a later resume."""
        with self._cond:
            self._cancelled = True
            self.keep_partial = keep_partial
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def wait_while_paused(self) -> None:
        with self._cond:
            while self._paused and not self._cancelled:
                self._cond.wait(0.5)


class _Cancelled(Exception):
    pass


class _Paused(Exception):
    pass


ProgressFn = Callable[[DownloadProgress], None]


def content_hash(path: Path, etag: str) -> str:
    """The hash an etag stands for: sha256 of the content for 64-hex etags (LFS), the git
    blob sha1 (``sha1(b"blob <size>\\0" + content)``) for 40-hex ones."""
    if len(etag) == 40:
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's id
    else:
        h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Downloader:
    """Runs download jobs into a huggingface_hub cache directory.

    ``free_bytes`` reports free disk space for a path (tests inject a number);
    ``max_retries`` bounds consecutive failed attempts per file (an attempt that made
    progress resets the count, so a flaky link still finishes a large file)."""

    def __init__(self, cache_dir: Path | None = None, endpoint: str | None = None,
                 token: str | bool | None = None, *, max_retries: int = 5,
                 backoff_s: float = 1.0, chunk_bytes: int = 1 << 20,
                 free_bytes: Callable[[Path], int] = free_disk_bytes,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.endpoint = endpoint
        self.token = token
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.chunk_bytes = chunk_bytes
        self.free_bytes = free_bytes
        self.sleep = sleep

    # -- state on disk -------------------------------------------------------------------

    def _cache(self, item: DownloadItem) -> RepoCache:
        return RepoCache(self.cache_dir, item.repo_id)

    def is_complete(self, item: DownloadItem) -> bool:
        blob = self._cache(item).blob(item.etag)
        return blob.is_file() and blob.stat().st_size == item.n_bytes

    def partial_bytes(self, item: DownloadItem) -> int:
        """Bytes already on disk for ``item`` (its whole size once complete)."""
        if self.is_complete(item):
            return item.n_bytes
        part = self._cache(item).incomplete(item.etag)
        return part.stat().st_size if part.is_file() else 0

    def discard_partial(self, items: tuple[DownloadItem, ...]) -> None:
        """Delete the ``.incomplete`` files of ``items`` (complete blobs stay)."""
        for item in items:
            self._cache(item).incomplete(item.etag).unlink(missing_ok=True)

    # -- the pipeline --------------------------------------------------------------------

    def run(self, items: tuple[DownloadItem, ...], control: DownloadControl | None = None,
            on_progress: ProgressFn | None = None) -> DownloadResult:
        """Download ``items`` into the cache; return their snapshot paths. Raises
        NotEnoughDiskError before fetching anything, NetworkUnavailableError or
        HubServerError after the retries, ChecksumMismatchError (the bad file removed),
        DownloadCancelledError. Files finished before a failure stay in the cache."""
        control = control or DownloadControl()
        t0 = time.monotonic()
        urls = [self._metadata(item) for item in items]
        n_total = sum(i.n_bytes for i in items)
        n_have = [self.partial_bytes(i) for i in items]
        self._check_disk(items, n_have)
        state = _JobState(items, n_total, sum(n_have), on_progress, t0)
        n_resumed = sum(h for i, h in zip(items, n_have, strict=True)
                        if h < i.n_bytes)
        paths = []
        try:
            for index, (item, url) in enumerate(zip(items, urls, strict=True)):
                state.index = index
                paths.append(self._fetch(item, url, control, state))
        except _Cancelled:
            if not control.keep_partial:
                self.discard_partial(items)
            raise DownloadCancelledError(control.keep_partial) from None
        return DownloadResult(tuple(paths), state.n_fetched, n_resumed, state.n_retries,
                              time.monotonic() - t0)

    def _metadata(self, item: DownloadItem) -> str:
        """The URL to fetch, after checking (HEAD: X-Linked-Etag, X-Linked-Size) that the
        Hub still reports the file the listing described."""
        url = resolve_url(item.repo_id, item.filename, item.commit, self.endpoint)
        if self.is_complete(item):
            return url  # nothing to fetch: no need to ask the Hub
        from huggingface_hub import get_hf_file_metadata

        meta = self._with_retries(lambda: get_hf_file_metadata(url, token=self.token),
                                  f"asking the Hub about {item.filename}")
        if meta.etag and meta.etag != item.etag:
            raise DownloadError(f"{item.filename}: the Hub now reports etag {meta.etag}, "
                                f"expected {item.etag}; refresh the listing")
        if meta.size is not None and meta.size != item.n_bytes:
            raise DownloadError(f"{item.filename}: the Hub reports {meta.size} bytes, "
                                f"expected {item.n_bytes}")
        # Fetch through the resolve URL, not meta.location: the CDN's signed URL expires,
        # and every attempt (after a pause, hours later) needs a fresh redirect.
        return url

    def _with_retries(self, fn, what: str):  # noqa: ANN001, ANN202 - one API call
        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified here
                if not is_transient(exc) or attempt == self.max_retries:
                    raise typed_error(exc, what) from exc
                self.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _check_disk(self, items: tuple[DownloadItem, ...], n_have: list[int]) -> None:
        n_needed = sum(i.n_bytes - h for i, h in zip(items, n_have, strict=True))
        if n_needed <= 0:
            return
        n_free = self.free_bytes(self.cache_dir)
        if n_needed > n_free:
            raise NotEnoughDiskError(n_needed, n_free, str(self.cache_dir))

    def _fetch(self, item: DownloadItem, url: str, control: DownloadControl,
               state: _JobState) -> Path:
        cache = self._cache(item)
        if not self.is_complete(item):
            from filelock import FileLock

            lock = cache.lock(item.etag)
            lock.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(lock)):
                self._transfer(item, url, control, state)
                self._verify_and_move(item, state)
        path = cache.link_snapshot(item.etag, item.commit, item.filename)
        cache.write_ref(item.revision, item.commit)
        return path

    def _transfer(self, item: DownloadItem, url: str, control: DownloadControl,
                  state: _JobState) -> None:
        """Fill the ``.incomplete`` file up to the item's size, resuming with Range."""
        if self.is_complete(item):  # another process finished it while we waited
            return
        part = self._cache(item).incomplete(item.etag)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.touch()
        n_failures = 0
        while (pos := part.stat().st_size) < item.n_bytes:
            if control.cancelled:
                raise _Cancelled
            try:
                self._stream(url, part, pos, item, control, state)
                n_failures = 0 if part.stat().st_size > pos else n_failures + 1
                if part.stat().st_size < item.n_bytes:
                    # The body ended early without an error: a dropped connection too.
                    state.n_retries += 1
                    state.emit(item.filename, "retry")
            except _Cancelled:
                raise
            except _Paused:
                state.emit(item.filename, "paused")
                control.wait_while_paused()
                continue
            except Exception as exc:  # noqa: BLE001 - classified here
                if not is_transient(exc):
                    raise typed_error(exc, f"downloading {item.filename}") from exc
                n_failures = 0 if part.stat().st_size > pos else n_failures + 1
                log.info("%s: attempt failed at byte %d: %s", item.filename, pos, exc)
                if n_failures > self.max_retries:
                    raise typed_error(exc, f"downloading {item.filename} "
                                           f"({self.max_retries} retries)") from exc
                state.n_retries += 1
                state.emit(item.filename, "retry")
                self.sleep(self.backoff_s * 2 ** max(0, n_failures - 1))
                continue
            if n_failures > self.max_retries:
                raise DownloadError(f"{item.filename}: the server keeps ending the file "
                                    f"early at byte {pos} of {item.n_bytes}")
        if part.stat().st_size > item.n_bytes:
            part.unlink()
            raise DownloadError(f"{item.filename}: the server sent more than the "
                                f"{item.n_bytes} bytes the Hub reported")

    def _headers(self) -> dict[str, str]:
        """The Hub token, if any (open_range drops it on a redirect to another host)."""
        if self.token is False:
            return {}
        from huggingface_hub.utils import build_hf_headers

        headers = build_hf_headers(token=self.token, library_name="tandem")
        return {k: v for k, v in headers.items() if k.lower() == "authorization"}

    def _stream(self, url: str, part: Path, pos: int, item: DownloadItem,
                control: DownloadControl, state: _JobState) -> None:
        """One attempt: GET from ``pos`` and append until the body ends, a pause or a
        cancel. Raises what urllib raises, _Paused or _Cancelled."""
        try:
            resp = open_range(url, pos, headers=self._headers())
        except urllib.error.HTTPError as exc:
            if exc.code != 416:
                raise
            # Range not satisfiable: the partial file does not fit the server's; restart.
            log.info("%s: the server refused byte %d, starting over", item.filename, pos)
            state.n_done -= pos
            part.write_bytes(b"")
            return
        with resp:
            if resp.status == 200 and pos > 0:
                log.info("%s: the server ignored Range, starting over", item.filename)
                part.write_bytes(b"")
                state.n_done -= pos
            elif resp.status == 206:
                start = _content_range_start(resp.headers.get("Content-Range", ""))
                if start != pos:
                    raise DownloadError(f"{item.filename}: asked for byte {pos}, the server "
                                        f"sent from {start}")
            with part.open("ab") as f:
                # read1: whatever has arrived (up to a chunk), so pause and cancel answer
                # within one network read even on a slow link.
                while chunk := resp.read1(self.chunk_bytes):
                    f.write(chunk)
                    state.advance(len(chunk), item.filename)
                    if control.cancelled:
                        raise _Cancelled
                    if control.paused:
                        raise _Paused  # closes the connection; the resume asks with Range

    def _verify_and_move(self, item: DownloadItem, state: _JobState) -> None:
        cache = self._cache(item)
        part = cache.incomplete(item.etag)
        state.emit(item.filename, "verify")
        actual = content_hash(part, item.etag)
        if actual != item.etag:
            part.unlink()
            state.n_done -= item.n_bytes
            raise ChecksumMismatchError(item.filename, item.etag, actual)
        os.replace(part, cache.blob(item.etag))  # atomic: a blob is always complete


def _content_range_start(value: str) -> int | None:
    # "bytes 100-199/1000"
    try:
        return int(value.split()[1].split("-")[0])
    except (IndexError, ValueError):
        return None


class _JobState:
    """Byte counts of a running job and the throttled progress reports."""

    def __init__(self, items: tuple[DownloadItem, ...], n_total: int, n_done: int,
                 on_progress: ProgressFn | None, t0: float) -> None:
        self.items, self.n_total, self.n_done = items, n_total, n_done
        self.on_progress, self.t0 = on_progress, t0
        self.index = 0
        self.n_fetched = 0
        self.n_retries = 0
        self._t_last = 0.0

    def advance(self, n: int, filename: str) -> None:
        self.n_done += n
        self.n_fetched += n
        now = time.monotonic()
        if now - self._t_last >= 0.1 or self.n_done >= self.n_total:
            self._t_last = now
            self.emit(filename, "download")

    def emit(self, filename: str, phase: str) -> None:
        if self.on_progress is None:
            return
        dt = max(time.monotonic() - self.t0, 1e-6)
        self.on_progress(DownloadProgress(filename, self.index, len(self.items),
                                          self.n_done, self.n_total, phase,
                                          self.n_fetched / dt))
