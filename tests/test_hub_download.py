"""The download pipeline against a local fake Hub: resume after drops and restarts,
hash checks, retries, disk space, pause and cancel, the huggingface_hub cache layout,
and import of local GGUF files."""

from __future__ import annotations

import hashlib
import socket
import threading
from pathlib import Path

import pytest

from engine.errors import (
    ChecksumMismatchError,
    DownloadCancelledError,
    HubServerError,
    ModelLoadError,
    NetworkUnavailableError,
    NotEnoughDiskError,
)
from engine.hub.cache_layout import RepoCache
from engine.hub.catalog import matching_heads
from engine.hub.download import DownloadControl, Downloader, DownloadProgress
from engine.hub.install import find_choice, install, job_items
from engine.hub.local_models import ModelRegistry, import_gguf
from engine.hub.search import read_remote_facts
from tests.hub_server import HEAD_REPO, TARGET_REPO, FakeHub, standard_repos, write_tiny_gguf

Q4 = "Tiny-Llama-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory):
    return standard_repos(tmp_path_factory.mktemp("repos"))


@pytest.fixture()
def hub(repos):
    with FakeHub(repos) as h:
        yield h


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "hf-cache"


def downloader(hub: FakeHub, cache: Path, **kw) -> Downloader:
    kw.setdefault("chunk_bytes", 16 * 1024)
    return Downloader(cache, hub.endpoint, token=False, backoff_s=0.0, **kw)


def q4_items(hub: FakeHub):
    return job_items(find_choice(TARGET_REPO, "Q4_K_M", endpoint=hub.endpoint))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_download_lands_in_the_hf_cache_layout(hub: FakeHub, cache: Path) -> None:
    from huggingface_hub import hf_hub_download

    seen: list[DownloadProgress] = []
    result = downloader(hub, cache).run(q4_items(hub), on_progress=seen.append)
    repo = hub.repos[TARGET_REPO]
    (path,) = result.paths
    assert path == cache / "models--bartowski--Tiny-Llama-GGUF" / "snapshots" / repo.commit / Q4
    assert path.is_symlink() and sha256(path) == repo.etag(Q4)
    assert (path.parent.parent.parent / "refs" / "main").read_text() == repo.commit
    assert not list(cache.rglob("*.incomplete"))
    assert seen[-1].n_done == seen[-1].n_total == len(repo.files[Q4])
    assert {p.phase for p in seen} >= {"download", "verify"}
    # Other tools find it without the network.
    again = hf_hub_download(TARGET_REPO, Q4, cache_dir=cache, local_files_only=True)
    assert Path(again) == path


def test_dropped_connection_resumes_with_range(hub: FakeHub, cache: Path) -> None:
    hub.faults.drop_after[Q4] = [50_000, 30_000]
    result = downloader(hub, cache).run(q4_items(hub))
    assert sha256(result.paths[0]) == hub.repos[TARGET_REPO].etag(Q4)
    assert hub.file_gets(Q4) == [None, "bytes=50000-", "bytes=80000-"]
    assert result.n_retries == 2


def test_checksum_mismatch_refuses_the_file(hub: FakeHub, cache: Path, tmp_path: Path) -> None:
    hub.faults.corrupt.add(Q4)
    registry = ModelRegistry(tmp_path / "models.json")
    choice = find_choice(TARGET_REPO, Q4, endpoint=hub.endpoint)
    with pytest.raises(ChecksumMismatchError, match="sha256") as info:
        install(choice, None, downloader(hub, cache), registry)
    assert info.value.expected == hub.repos[TARGET_REPO].etag(Q4)
    rc = RepoCache(cache, TARGET_REPO)
    assert not rc.blob(info.value.expected).exists()
    assert not rc.incomplete(info.value.expected).exists()
    assert not rc.snapshot(choice.commit, Q4).exists()
    assert registry.list() == []  # never offered as a model


def test_server_errors_retry_then_fail_clearly(hub: FakeHub, cache: Path) -> None:
    hub.faults.statuses[Q4] = [503, 502]  # two failures: the retries get through
    d = downloader(hub, cache, max_retries=3)
    assert d.run(q4_items(hub)).n_retries == 2

    hub.faults.statuses["Tiny-Llama-Q8_0.gguf"] = [503] * 10
    items = job_items(find_choice(TARGET_REPO, "Q8_0", endpoint=hub.endpoint))
    with pytest.raises(HubServerError, match="HTTP 503") as info:
        downloader(hub, cache, max_retries=2).run(items)
    assert info.value.status == 503
    assert len(hub.file_gets("Tiny-Llama-Q8_0.gguf")) == 3  # one try, two retries


def test_no_network(hub: FakeHub, cache: Path) -> None:
    items = q4_items(hub)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Downloader(cache, f"http://127.0.0.1:{port}", token=False, backoff_s=0.0,
                   max_retries=1)
    with pytest.raises(NetworkUnavailableError, match="cannot reach the Hub"):
        d.run(items)


def test_not_enough_disk_space_checked_before_fetching(hub: FakeHub, cache: Path) -> None:
    items = q4_items(hub)
    with pytest.raises(NotEnoughDiskError, match="GiB free") as info:
        downloader(hub, cache, free_bytes=lambda _p: 1000).run(items)
    assert info.value.n_needed == items[0].n_bytes and info.value.n_free == 1000
    assert hub.file_gets(Q4) == []


def _cancel_after(control: DownloadControl, n_bytes: int, keep: bool):
    # Progress reports come at most every 0.1 s; the first comes after the first chunk.
    def on_progress(p: DownloadProgress) -> None:
        if p.phase == "download" and p.n_done >= n_bytes:
            control.cancel(keep_partial=keep)
    return on_progress


def test_cancel_keeps_partial_and_a_new_downloader_resumes(hub: FakeHub, cache: Path) -> None:
    items = q4_items(hub)
    control = DownloadControl()
    with pytest.raises(DownloadCancelledError, match="kept") as info:
        downloader(hub, cache).run(items, control, _cancel_after(control, 1, True))
    assert info.value.kept_partial
    part = RepoCache(cache, TARGET_REPO).incomplete(items[0].etag)
    n_part = part.stat().st_size
    assert 0 < n_part < items[0].n_bytes
    # "Restart": a fresh Downloader finds the partial file and asks for the rest.
    fresh = downloader(hub, cache)
    assert fresh.partial_bytes(items[0]) == n_part
    result = fresh.run(items)
    assert result.n_resumed == n_part and result.n_downloaded == items[0].n_bytes - n_part
    assert hub.file_gets(Q4)[-1] == f"bytes={n_part}-"
    assert sha256(result.paths[0]) == items[0].etag


def test_cancel_can_remove_the_partial(hub: FakeHub, cache: Path) -> None:
    items = q4_items(hub)
    control = DownloadControl()
    with pytest.raises(DownloadCancelledError, match="removed"):
        downloader(hub, cache).run(items, control, _cancel_after(control, 1, False))
    assert not list(cache.rglob("*.incomplete"))


def test_pause_and_resume(hub: FakeHub, cache: Path) -> None:
    items = q4_items(hub)
    control = DownloadControl()
    paused = threading.Event()

    def on_progress(p: DownloadProgress) -> None:
        if p.phase == "download" and not paused.is_set():
            control.pause()
        if p.phase == "paused":
            paused.set()

    out: list = []
    worker = threading.Thread(target=lambda: out.append(
        downloader(hub, cache).run(items, control, on_progress)))
    worker.start()
    assert paused.wait(10)
    part = RepoCache(cache, TARGET_REPO).incomplete(items[0].etag)
    n_paused = part.stat().st_size
    assert n_paused < items[0].n_bytes and worker.is_alive()
    control.resume()
    worker.join(10)
    assert sha256(out[0].paths[0]) == items[0].etag
    assert hub.file_gets(Q4)[-1] == f"bytes={n_paused}-"


def test_target_and_head_install_as_one_model(hub: FakeHub, cache: Path, tmp_path: Path
                                              ) -> None:
    choice = find_choice(TARGET_REPO, "Q4_K_M", endpoint=hub.endpoint)
    facts = read_remote_facts(choice, endpoint=hub.endpoint)
    head = next(h for h in matching_heads(TARGET_REPO, facts, endpoint=hub.endpoint)
                if h.repo_id == HEAD_REPO)
    registry = ModelRegistry(tmp_path / "models.json")
    model, result = install(choice, head, downloader(hub, cache), registry)
    assert len(result.paths) == 3
    assert model.name == f"{TARGET_REPO}:Q4_K_M" and Path(model.path).is_file()
    head_dir = Path(model.head_dir or "")
    assert (head_dir / "head.json").is_file() and (head_dir / "head.safetensors").is_file()
    assert [m.name for m in ModelRegistry(tmp_path / "models.json").list()] == [model.name]
    # Removing with the files deletes the blob too.
    registry.remove(model.name, delete_files=True, cache_dir=cache)
    assert not Path(model.path).exists() and registry.list() == []
    assert not RepoCache(cache, TARGET_REPO).blob(choice.files[0].etag).exists()


def test_import_local_gguf_and_refuse_others(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path / "models.json")
    gguf_path = write_tiny_gguf(tmp_path / "mine-Q8_0.gguf")
    model = import_gguf(gguf_path, registry)
    assert (model.name, model.source, model.quant) == ("mine-Q8_0", "import", "Q8_0")
    assert registry.get("mine-Q8_0").path == str(gguf_path.resolve())

    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        import_gguf(text, registry)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="cannot be read"):
        import_gguf(broken, registry)
    vocab = write_tiny_gguf(tmp_path / "vocab-only.gguf", vocab_only=True)
    with pytest.raises(ModelLoadError, match="vocabulary-only"):
        import_gguf(vocab, registry)
    assert [m.name for m in registry.list()] == ["mine-Q8_0"]
