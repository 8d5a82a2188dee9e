"""The files server (app.tools.files_server) stays in its folder: no path outside it, no
symbolic link followed, no hidden file, no FIFO opened, reads and searches bounded. Each
check is made twice where it can be: on the tools' functions with plain text (what a
client that ignores the schema's enum sends), and through the MCP protocol against the
real server process, over a folder too large for the enum, so the folder check alone
decides."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import app.tools.files_server as files_server
from app.tools.files_server import MAX_CHOICES, MAX_READ_CHARS, Folder, OutsideFolder, make_server
from app.tools.mcp_host import RUNNING, McpHost
from app.tools.server_config import ServerConfig

SECRET = "SECRET-4471"  # in every file the server must not show
HANG_GUARD_S = 30  # a call still running then is stuck (a FIFO opened): unblocked, failed


def _secret(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{SECRET}: you should not see this\n")


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    """A folder with visible files, and beside them everything the server must not reach:
    links out of it (to a file and to a folder), links inside it, hidden folders, a FIFO."""
    _secret(tmp_path / "outside.txt")
    _secret(tmp_path / "outside_dir" / "secret.txt")
    root = tmp_path / "files"
    (root / "notes").mkdir(parents=True)
    (root / "a.txt").write_text("The harbour opens at six.\n")
    (root / "notes" / "b.md").write_text("# Ferry\nThe ferry leaves at nine.\n")
    (root / "link.txt").symlink_to(tmp_path / "outside.txt")
    (root / "linkdir").symlink_to(tmp_path / "outside_dir", target_is_directory=True)
    (root / "inside_link.txt").symlink_to(root / "a.txt")
    (root / "inside_dir_link").symlink_to(root / "notes", target_is_directory=True)
    _secret(root / ".git" / "config")
    _secret(root / ".ssh" / "id_rsa")
    _secret(root / ".env")
    _secret(root / "notes" / ".hidden.md")
    os.mkfifo(root / "fifo")
    return root


REFUSED = ["../outside.txt", "notes/../../outside.txt", "link.txt", "linkdir/secret.txt",
           "inside_link.txt", "inside_dir_link/b.md", ".git/config", ".ssh/id_rsa", ".env",
           "notes/.hidden.md", "fifo"]


def _bounded(call: Callable[[], str], fifo: Path) -> str:
    """``call()``'s result, or the test fails if it blocks (as opening a FIFO does): the
    FIFO gets a writer that closes at once, which ends the blocked read."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = call()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        with open(fifo, "w"):  # unblocks the reader's open; closing ends its read
            pass
        thread.join(HANG_GUARD_S)
        pytest.fail("the call blocked (it opened the FIFO)")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return str(out["result"])


@pytest.mark.parametrize("path", REFUSED)
def test_paths_outside_hidden_through_links_or_not_regular_are_refused(
        root: Path, path: str) -> None:
    folder = Folder(root)
    with pytest.raises(OutsideFolder):
        _bounded(lambda: folder.read_file(path), root / "fifo")


def test_absolute_paths_are_refused_even_inside_the_folder(root: Path) -> None:
    folder = Folder(root)
    for path in (root.parent / "outside.txt", root / "a.txt", Path("/etc/passwd")):
        with pytest.raises(OutsideFolder, match="relative"):
            folder.read_file(str(path))
    with pytest.raises(OutsideFolder):
        folder.list_files(str(root.parent / "outside_dir"))


def test_the_files_it_may_read_are_read(root: Path) -> None:
    folder = Folder(root)
    assert folder.read_file("notes/b.md") == "# Ferry\nThe ferry leaves at nine.\n"
    assert folder.read_file("./a.txt") == "The harbour opens at six.\n"
    with pytest.raises(FileNotFoundError):
        folder.read_file("no-such.txt")


def test_listing_and_search_show_only_the_visible_regular_files_inside(root: Path) -> None:
    folder = Folder(root)
    listing = _bounded(folder.list_files, root / "fifo")
    assert [line.split(" (")[0] for line in listing.splitlines()] == ["a.txt", "notes/b.md"]
    assert _bounded(lambda: folder.search_files(SECRET), root / "fifo") == \
        f"no line contains {SECRET!r}"
    assert "notes/b.md:2:" in folder.search_files("FERRY L")
    assert folder.list_files("notes") == "notes/b.md (34 bytes)"
    for bad in ("linkdir", "inside_dir_link", ".git", ".ssh", "..", "notes/../.."):
        with pytest.raises(OutsideFolder):
            folder.list_files(bad)


def test_a_large_file_is_read_and_searched_in_bounded_memory(tmp_path: Path,
                                                            monkeypatch) -> None:  # noqa: ANN001
    root = tmp_path / "files"
    root.mkdir()
    line = "x" * 99 + "\n"
    with open(root / "big.txt", "w") as f:  # 8 MiB, the needle at its start and its end
        f.write("needle-early\n" + line * (8 * 1024 * 1024 // len(line)) + "needle-late\n")
    folder = Folder(root)
    tracemalloc.start()
    try:
        text = folder.read_file("big.txt")
        _, read_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        early, late = folder.search_files("needle-early"), folder.search_files("needle-late")
        _, search_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert text.startswith("needle-early\n") and "truncated" in text.splitlines()[-1]
    assert len(text) < MAX_READ_CHARS + 200
    # The file is 8 MiB: neither call held it whole (a read takes 256 KiB, a search 1 MiB).
    assert read_peak < 2 * 1024 * 1024, read_peak
    assert search_peak < 6 * 1024 * 1024, search_peak
    assert early.startswith("big.txt:1: needle-early")
    assert late == "no line contains 'needle-late'"  # past what a search reads of a file
    # Hits and files searched are bounded too.
    (root / "many.txt").write_text("hit\n" * 100)
    assert len(folder.search_files("hit").splitlines()) == files_server.MAX_HITS
    monkeypatch.setattr(files_server, "MAX_SCAN_FILES", 1)
    assert folder.search_files("nothing-here").endswith("(searched the first 1 files only)")


def test_the_schema_offers_only_what_may_be_read(root: Path) -> None:
    tools = {t.name: t for t in asyncio.run(make_server(root).list_tools())}
    assert tools["read_file"].input_schema["properties"]["path"]["enum"] == \
        ["a.txt", "notes/b.md"]
    assert tools["list_files"].input_schema["properties"]["folder"]["enum"] == ["", "notes"]


@pytest.fixture()
def host() -> Iterator[McpHost]:
    h = McpHost(call_timeout_s=HANG_GUARD_S)
    yield h
    h.close()


def test_through_the_protocol_with_no_enum_the_folder_check_refuses(root: Path,
                                                                   host: McpHost) -> None:
    """Past MAX_CHOICES files the schema takes any text: only the folder check stands
    between a model's argument and the disk."""
    for i in range(MAX_CHOICES + 1):
        (root / "notes" / f"n{i:03d}.txt").write_text(f"note {i}\n")
    host.start(ServerConfig("files", sys.executable, ("-m", "app.tools.files_server",
                                                      str(root))))
    status = host.wait_started("files")
    assert status.state == RUNNING, status.message
    read = next(t for t in status.tools if t.name == "read_file")
    assert "enum" not in str(read.schema)
    ok = host.call("files", "read_file", {"path": "notes/n007.txt"}).result(HANG_GUARD_S)
    assert ok.text == "note 7\n" and not ok.is_error
    for path in [*REFUSED, str(root.parent / "outside.txt")]:
        outcome = host.call("files", "read_file", {"path": path}).result(HANG_GUARD_S)
        assert outcome.is_error and SECRET not in outcome.text, (path, outcome)
    for folder in ("linkdir", ".git", "../outside_dir"):
        outcome = host.call("files", "list_files", {"folder": folder}).result(HANG_GUARD_S)
        assert outcome.is_error and SECRET not in outcome.text, (folder, outcome)
    found = host.call("files", "search_files", {"text": SECRET}).result(HANG_GUARD_S)
    assert found.text == f"no line contains {SECRET!r}"
