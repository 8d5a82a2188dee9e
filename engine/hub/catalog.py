"""Which draft heads go with a target: a catalog of known pairs, plus head repositories
on the Hub whose ``head.json`` fingerprint fits the target's shape.

A head repository holds ``head.json`` (models.head_config.HeadConfig, with the
TargetFingerprint it was trained against) and ``head.safetensors``. Before a download
only the target's vocabulary size and hidden size are known (from its GGUF header);
the tokenizer hash is checked when the pair is loaded, as every pair is."""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.gguf.header import GGUFFacts
from engine.hub.remote import call_api, fetch_prefix, make_api, resolve_url
from engine.hub.search import RemoteFile, list_repo
from models.head_config import HeadConfig, TargetFingerprint

log = logging.getLogger(__name__)

HEAD_FILES = ("head.json", "head.safetensors")
HEAD_TAG = "tandem-draft-head"  # the Hub tag head repositories carry
CATALOG_FILE = "head_catalog.json"  # in Tandem's data directory: user additions


@dataclass(frozen=True)
class HeadPair:
    """A known pairing: targets whose repo id matches ``target_pattern`` (fnmatch,
    case-insensitive) take the head in ``head_repo``."""

    target_pattern: str
    head_repo: str

    def matches(self, target_repo: str) -> bool:
        return fnmatch.fnmatch(target_repo.lower(), self.target_pattern.lower())


# Heads published for Tandem. Empty until the first trained heads are on the Hub; users
# and tests add pairs through ``<data dir>/head_catalog.json`` or the ``catalog``
# argument: [{"target_pattern": "*SmolLM2-135M-Instruct*", "head_repo": "me/head"}].
KNOWN_HEADS: tuple[HeadPair, ...] = ()


def load_catalog(data_dir: Path | None = None) -> tuple[HeadPair, ...]:
    """The built-in pairs plus the user's file in ``data_dir`` (when it exists). A broken
    file is logged and skipped: it must not stop the wizard."""
    pairs = list(KNOWN_HEADS)
    path = data_dir / CATALOG_FILE if data_dir else None
    if path is not None and path.is_file():
        try:
            pairs += [HeadPair(str(e["target_pattern"]), str(e["head_repo"]))
                      for e in json.loads(path.read_text())]
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
    return tuple(pairs)


@dataclass(frozen=True)
class HeadChoice:
    """A draft head that fits a target; ``source`` is "catalog" or "fingerprint"."""

    repo_id: str
    commit: str
    files: tuple[RemoteFile, ...]
    source: str
    trained_for: TargetFingerprint | None

    @property
    def n_bytes(self) -> int:
        return sum(f.n_bytes for f in self.files)


def fits_shape(fp: TargetFingerprint | None, facts: GGUFFacts | None) -> bool:
    """Whether a head trained for ``fp`` can fit a target with these header facts:
    vocabulary and hidden size equal (unknown values do not count against it)."""
    if fp is None or facts is None:
        return False
    return ((facts.vocab_size is None or fp.vocab_size == facts.vocab_size)
            and (facts.hidden_size is None or fp.hidden_size == facts.hidden_size))


def _head_choice(repo_id: str, source: str, fp: TargetFingerprint | None,
                 endpoint: str | None) -> HeadChoice | None:
    listing = list_repo(repo_id, endpoint=endpoint)
    try:
        files = tuple(listing.file(name) for name in HEAD_FILES)
    except KeyError as exc:
        log.info("%s is not a head repository: %s", repo_id, exc)
        return None
    return HeadChoice(repo_id, listing.commit, files, source, fp)


def _remote_fingerprint(repo_id: str, endpoint: str | None) -> TargetFingerprint | None:
    url = resolve_url(repo_id, "head.json", "main", endpoint)
    try:
        return HeadConfig.from_json(fetch_prefix(url, 1 << 20).decode()).target
    except Exception as exc:  # noqa: BLE001 - one odd repository must not end the search
        log.info("skipping %s: %s", repo_id, exc)
        return None


def matching_heads(target_repo: str, facts: GGUFFacts | None, *,
                   catalog: tuple[HeadPair, ...] = KNOWN_HEADS, endpoint: str | None = None,
                   discover: bool = True, limit: int = 20) -> list[HeadChoice]:
    """Draft heads for ``target_repo``: catalog pairs first, then (``discover``) repos
    tagged ``tandem-draft-head`` whose fingerprint fits ``facts``. Raises
    NetworkUnavailableError or HubServerError when the Hub cannot be asked."""
    out: list[HeadChoice] = []
    seen: set[str] = set()
    for pair in catalog:
        if pair.matches(target_repo) and pair.head_repo not in seen:
            choice = _head_choice(pair.head_repo, "catalog", None, endpoint)
            if choice is not None:
                out.append(choice)
                seen.add(pair.head_repo)
    if not discover or facts is None:
        return out
    api = make_api(endpoint)
    repos = call_api(lambda: [m.id for m in api.list_models(filter=HEAD_TAG, limit=limit)],
                     "searching the Hub for draft heads")
    for repo_id in repos:
        if repo_id in seen:
            continue
        fp = _remote_fingerprint(repo_id, endpoint)
        if fits_shape(fp, facts):
            choice = _head_choice(repo_id, "fingerprint", fp, endpoint)
            if choice is not None:
                out.append(choice)
                seen.add(repo_id)
    return out
