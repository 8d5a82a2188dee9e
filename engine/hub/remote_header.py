"""A remote GGUF's header, shape and vocabulary, by ranged reads of its first bytes.

The token list sits in the header, after the architecture keys: a few MiB for large
vocabularies (Gemma 3's 262k tokens, Llama 3's 280k merges before the BOS/EOS keys).
The read starts small and grows until the metadata is complete or a cap is reached;
a header cut by the cap still says what it can (see engine.gguf.vocab_header)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.gguf.draft_compat import VocabFacts
from engine.gguf.header import GGUFFacts, facts_from_kv
from engine.gguf.vocab_header import header_vocab, read_section
from engine.hub.remote import fetch_prefix, fetch_range, resolve_url
from engine.hub.search import GGUFChoice

log = logging.getLogger(__name__)

# Each read ends at the next size; a small model's header fits in the first.
READ_STEPS = (512 * 1024, 4 << 20, 16 << 20, 32 << 20)
MAX_HEADER_BYTES = READ_STEPS[-1]


@dataclass(frozen=True)
class RemoteHeader:
    """What the start of a remote GGUF says. ``complete``: all its metadata was read."""

    facts: GGUFFacts
    vocab: VocabFacts | None  # None: no token list within the bytes read
    n_bytes_read: int
    complete: bool


def read_remote_header(choice: GGUFChoice, *, endpoint: str | None = None,
                       max_bytes: int = MAX_HEADER_BYTES) -> RemoteHeader | None:
    """The header of ``choice``'s first file, read in growing ranges up to
    ``max_bytes``; None when it cannot be read (logged: callers fall back to sizes)."""
    url = resolve_url(choice.repo_id, choice.name, choice.commit, endpoint)
    name = f"{choice.repo_id}/{choice.name}"
    steps = [s for s in READ_STEPS if s < max_bytes] + [max_bytes]
    try:
        requested = steps[0]
        data = fetch_prefix(url, requested)
        section = read_section(data)
        for size in steps[1:]:
            if section.complete or len(data) < requested:
                break  # all metadata read, or the file ended
            data += fetch_range(url, len(data), size - 1)
            requested = size
            section = read_section(data)
    except Exception as exc:  # noqa: BLE001 - a missing header only costs the check
        log.info("no header for %s: %s", name, exc)
        return None
    if not section.complete:
        log.info("%s: metadata not complete in its first %d bytes", name, len(data))
    return RemoteHeader(facts_from_kv(section.kv), header_vocab(section, name), len(data),
                        section.complete)

