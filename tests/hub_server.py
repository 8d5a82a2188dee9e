"""A small local stand-in for the Hugging Face Hub, for the model-hub tests.

It speaks the endpoints the real ``huggingface_hub`` client and Tandem's downloader use:
model search (``/api/models``), model info with file sizes and hashes
(``/api/models/{repo}[/revision/{rev}]?blobs=true``) and file resolve (HEAD and GET with
Range; X-Repo-Commit, X-Linked-Etag, X-Linked-Size, ETag). Faults are switched on per
file: dropped connections, 5xx answers, corrupted bytes, slow bodies."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    tags: list[str] = field(default_factory=lambda: ["gguf"])
    downloads: int = 0
    commit: str = ""
    lfs_suffixes: tuple[str, ...] = (".gguf", ".safetensors")

    def __post_init__(self) -> None:
        if not self.commit:
            self.commit = hashlib.sha1(self.repo_id.encode()).hexdigest()  # noqa: S324

    def is_lfs(self, name: str) -> bool:
        return name.endswith(self.lfs_suffixes)

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(name) else git_blob_id(data)

    def info(self) -> dict:
        siblings = []
        for name, data in self.files.items():
            s: dict = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if self.is_lfs(name):
                s["lfs"] = {"size": len(data), "sha256": self.etag(name), "pointerSize": 134}
            siblings.append(s)
        return {"id": self.repo_id, "modelId": self.repo_id, "sha": self.commit,
                "tags": self.tags, "downloads": self.downloads, "likes": 0,
                "private": False, "siblings": siblings}


@dataclass
class Faults:
    """Per-file misbehaviour, consumed as requests arrive."""

    drop_after: dict[str, list[int]] = field(default_factory=dict)  # close after n bytes
    statuses: dict[str, list[int]] = field(default_factory=dict)  # answer GET with these
    corrupt: set[str] = field(default_factory=set)  # flip bytes, report the true hash
    delay_per_chunk_s: float = 0.0


class FakeHub:
    """Serve ``repos`` on 127.0.0.1 (random port) from a thread; use as a context manager.
    ``requests`` logs (method, path, Range header) of every request."""

    CHUNK = 8192

    def __init__(self, repos: list[FakeRepo]) -> None:
        self.repos = {r.repo_id: r for r in repos}
        self.faults = Faults()
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def file_gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of file ``name``."""
        return [rng for m, p, rng in self.requests if m == "GET" and p.endswith("/" + name)]

    def _pop(self, table: dict[str, list[int]], name: str) -> int | None:
        with self._lock:
            queue = table.get(name)
            return queue.pop(0) if queue else None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self._route(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._route(head=False)

            def _json(self, payload: object, status: int = 200) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _route(self, head: bool) -> None:
                url = urlparse(self.path)
                path = unquote(url.path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) == 2:
                    return self._search(parse_qs(url.query))
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = hub.repos.get("/".join(parts[2:4]))
                    if repo is None:
                        return self._json({"error": "Repository not found"}, 404)
                    return self._json(repo.info())
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = hub.repos.get("/".join(parts[:2]))
                    name = "/".join(parts[4:])
                    if repo is None or name not in repo.files:
                        return self._json({"error": "Entry not found"}, 404)
                    return self._file(repo, name, head)
                return self._json({"error": "not found"}, 404)

            def _search(self, q: dict[str, list[str]]) -> None:
                text = (q.get("search") or [""])[0].lower()
                wanted = set(q.get("filter", []))
                hits = [r for r in hub.repos.values()
                        if text in r.repo_id.lower() and wanted <= set(r.tags)]
                hits.sort(key=lambda r: -r.downloads)
                limit = int((q.get("limit") or ["1000"])[0])
                self._json([{"id": r.repo_id, "modelId": r.repo_id, "downloads": r.downloads,
                             "likes": 0, "tags": r.tags, "private": False}
                            for r in hits[:limit]])

            def _file(self, repo: FakeRepo, name: str, head: bool) -> None:
                data = repo.files[name]
                if not head and (status := hub._pop(hub.faults.statuses, name)):
                    return self._json({"error": "server error"}, status)
                start, end, status = 0, len(data) - 1, 200
                rng = self.headers.get("Range")
                if rng and not head:
                    a, _, b = rng.removeprefix("bytes=").partition("-")
                    start, end = int(a), int(b) if b else len(data) - 1
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return None
                    status = 206
                self.send_response(status)
                self.send_header("X-Repo-Commit", repo.commit)
                etag = f'"{repo.etag(name)}"'
                if repo.is_lfs(name):
                    self.send_header("X-Linked-Etag", etag)
                    self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("ETag", etag)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start + 1))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.end_headers()
                if head:
                    return None
                body = data[start:end + 1]
                if name in repo.files and name in hub.faults.corrupt:
                    body = bytes(b ^ 0xFF for b in body)
                drop = hub._pop(hub.faults.drop_after, name)
                if drop is not None:
                    body = body[:drop]
                for i in range(0, len(body), hub.CHUNK):
                    if hub.faults.delay_per_chunk_s:
                        time.sleep(hub.faults.delay_per_chunk_s)
                    try:
                        self.wfile.write(body[i:i + hub.CHUNK])
                    except OSError:
                        return None
                if drop is not None:
                    self.wfile.flush()
                    self.close_connection = True
                return None

        return Handler


def write_tiny_gguf(path: Path, *, n_vocab: int = 96, hidden: int = 64,
                    n_extra_bytes: int = 0, name: str = "tiny",
                    vocab_only: bool = False) -> Path:
    """A real, small llama-architecture GGUF (random weights): enough for header reads,
    sizes and hashes. ``n_extra_bytes`` adds a tensor to make the file larger;
    ``vocab_only`` writes no tensors at all (as llama.cpp's vocabulary files)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(2)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hidden * 2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}".encode() for i in range(n_vocab)])
    if not vocab_only:
        w.add_tensor("token_embd.weight",
                     rng.standard_normal((n_vocab, hidden), dtype=np.float32))
        for i in range(2):
            w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    if n_extra_bytes:
        n = max(1, n_extra_bytes // 4)
        w.add_tensor("extra.weight", rng.standard_normal((1, n), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TARGET_REPO = "bartowski/Tiny-Llama-GGUF"
HEAD_REPO = "tandem/tiny-llama-head"


def head_files(vocab: int, hidden: int) -> dict[str, bytes]:
    """A draft-head repository's files: head.json with the fingerprint, and weights."""
    import numpy as np
    from safetensors.numpy import save

    from models.head_config import HeadConfig, TargetFingerprint

    cfg = HeadConfig(hidden_size=hidden, n_heads=4, n_kv_heads=2, intermediate_size=2 * hidden,
                     target=TargetFingerprint(vocab, hidden, "ab" * 32))
    weights = save({"fc.weight": np.ones((hidden, 2 * hidden), dtype=np.float32)})
    return {"head.json": cfg.to_json().encode(), "head.safetensors": weights}


def standard_repos(tmp: Path) -> list[FakeRepo]:
    """The fake Hub's content: a target with two quantizations (the Q4_K_M one ~220 KiB),
    a smaller repo, a split model, and three head repositories (one that fits by
    fingerprint, one that does not, one found only through the catalog)."""
    def gguf_bytes(name: str, extra: int, hidden: int = 64) -> bytes:
        return write_tiny_gguf(tmp / name, n_extra_bytes=extra, hidden=hidden).read_bytes()

    return [
        FakeRepo(TARGET_REPO, {
            "README.md": b"# Tiny llama\n",
            "Tiny-Llama-Q4_K_M.gguf": gguf_bytes("q4.gguf", 200_000),
            "Tiny-Llama-Q8_0.gguf": gguf_bytes("q8.gguf", 400_000),
        }, downloads=100),
        FakeRepo("someone/Wide-Llama-GGUF", {
            "wide.F16.gguf": gguf_bytes("wide.gguf", 1000, hidden=128),
        }, downloads=5),
        FakeRepo("someone/Split-Llama-GGUF", {
            "split-Q4_0-00001-of-00002.gguf": gguf_bytes("s1.gguf", 1000),
            "split-Q4_0-00002-of-00002.gguf": b"GGUF" + bytes(3000),
        }, downloads=1),
        FakeRepo(HEAD_REPO, head_files(96, 64), tags=["tandem-draft-head"]),
        FakeRepo("tandem/wide-head", head_files(96, 128), tags=["tandem-draft-head"]),
        FakeRepo("tandem/catalog-head", head_files(96, 64), tags=["other"]),
    ]
