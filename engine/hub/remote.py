"""Talking to the Hub: the huggingface_hub client for the API, stdlib HTTP for byte
ranges, and one place that turns transport failures into Tandem's typed errors."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TypeVar

from engine.errors import DownloadError, HubServerError, NetworkUnavailableError

T = TypeVar("T")
USER_AGENT = "tandem/0.1"
TIMEOUT_S = 30.0


def make_api(endpoint: str | None = None, token: str | bool | None = None):  # noqa: ANN201
    """An ``HfApi`` for ``endpoint`` (None: HF_ENDPOINT or huggingface.co)."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token, library_name="tandem")


def resolve_url(repo_id: str, filename: str, revision: str, endpoint: str | None) -> str:
    """The ``/{repo}/resolve/{revision}/{file}`` URL of one file."""
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint)


def _status_of(exc: BaseException) -> int | None:
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help: 5xx, 429, timeouts and dropped or refused connections."""
    status = _status_of(exc)
    if status is not None:
        return status >= 500 or status == 429
    # http.client.IncompleteRead: the connection dropped mid-body.
    return isinstance(exc, OSError | http.client.HTTPException) or _is_transport(exc)


def _is_transport(exc: BaseException) -> bool:
    # huggingface_hub raises its HTTP library's transport errors (httpx/requests, by
    # version); recognise them by name rather than import either library.
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TransportError", "ConnectError", "ConnectionError", "TimeoutException",
                         "RemoteProtocolError", "ReadError", "NetworkError"})


def typed_error(exc: BaseException, what: str) -> DownloadError:
    """The Tandem error for a failure while doing ``what`` ("searching the Hub")."""
    if isinstance(exc, DownloadError):
        return exc
    status = _status_of(exc)
    if status is not None:
        hint = {401: " (a gated or private repository: log in with `hf auth login`)",
                403: " (access denied: accept the model's licence on the Hub)",
                404: " (no such repository, revision or file)"}.get(status, "")
        return HubServerError(f"{what}: the Hub answered HTTP {status}{hint}", status)
    if isinstance(exc, OSError | http.client.HTTPException) or _is_transport(exc):
        return NetworkUnavailableError(f"{what}: cannot reach the Hub ({exc}); check the "
                                       "network connection")
    return DownloadError(f"{what}: {exc}")


def call_api(fn: Callable[[], T], what: str) -> T:
    """Run one Hub API call; failures come back as DownloadError subclasses
    (NetworkUnavailableError, HubServerError). No retry: the caller asked and waits."""
    try:
        return fn()
    except DownloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - every client failure becomes a typed error
        raise typed_error(exc, what) from exc


class _DropAuthOnHostChange(urllib.request.HTTPRedirectHandler):
    """Follow redirects (the Hub sends file downloads to a CDN) keeping Range, but never
    forward the Hub token to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlparse(newurl).netloc != req.host:
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_DropAuthOnHostChange)


def open_range(url: str, start: int, end: int | None = None,
               headers: dict[str, str] | None = None, timeout: float = TIMEOUT_S):  # noqa: ANN201
    """GET ``url`` from byte ``start`` (to ``end`` inclusive). Returns the urllib
    response (status 200 when the server ignored the range, 206 when it honoured it);
    raises urllib.error.HTTPError/URLError/OSError as urllib does."""
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT,
                                               "Accept-Encoding": "identity",
                                               **(headers or {})})
    if start > 0 or end is not None:
        req.add_header("Range", f"bytes={start}-{'' if end is None else end}")
    return _OPENER.open(req, timeout=timeout)


def fetch_prefix(url: str, n_bytes: int, headers: dict[str, str] | None = None) -> bytes:
    """The first ``n_bytes`` of a remote file (fewer if it is shorter). Raises
    NetworkUnavailableError or HubServerError."""
    try:
        with open_range(url, 0, n_bytes - 1, headers) as resp:
            return resp.read(n_bytes)
    except Exception as exc:  # noqa: BLE001 - typed below
        raise typed_error(exc, f"reading the start of {url.rsplit('/', 1)[-1]}") from exc


def fetch_range(url: str, start: int, end: int,
                headers: dict[str, str] | None = None) -> bytes:
    """Bytes ``start``..``end`` (inclusive) of a remote file, fewer past its end; a
    server that ignores Range is read from 0 and the bytes before ``start`` dropped.
    Raises NetworkUnavailableError or HubServerError."""
    try:
        with open_range(url, start, end, headers) as resp:
            if resp.status == 206 or start == 0:
                return resp.read(end - start + 1)
            return resp.read(end + 1)[start:]
    except urllib.error.HTTPError as exc:
        if exc.code == 416:  # the file ends before ``start``
            return b""
        raise typed_error(exc, f"reading {url.rsplit('/', 1)[-1]}") from exc
    except Exception as exc:  # noqa: BLE001 - typed below
        raise typed_error(exc, f"reading {url.rsplit('/', 1)[-1]}") from exc
