"""A small MCP server over one folder: list, read and search its text files, nothing
outside it, nothing written. The tool-loop benchmark drives it, the tests too, and a user
can add it to try tools (Settings > Tools > Add: ``python -m app.tools.files_server
FOLDER``).

What it reaches: the regular files under FOLDER, and nothing else.

- Paths are relative to the folder; an absolute path, ``..`` or a path whose resolved
  form leaves the folder is refused.
- Symbolic links are never followed, wherever they point (inside the folder too): not
  listed, not searched, not read, and a path through one is refused. That is the simple
  rule that cannot leak: no link has to be judged.
- Hidden names (starting with '.': ``.git``, ``.ssh``, ``.env``) are skipped when listing
  and searching and refused when read.
- Only regular files are opened (a FIFO would block the server, a device never ends), and
  each read and each search is bounded: the first ``MAX_READ_BYTES`` of a file are read,
  ``MAX_READ_CHARS`` of them shown; a search reads ``MAX_SCAN_BYTES`` of at most
  ``MAX_SCAN_FILES`` files and stops at ``MAX_HITS`` lines.

The tools' schema offers the paths that exist as a list to choose from (an enum: it holds
a small model's arguments to real files), but the checks above never rely on it: the enum
is gone past ``MAX_CHOICES`` files, and a client may not validate it.

``python -m app.tools.files_server FOLDER`` speaks stdio; ``--http PORT`` serves
streamable HTTP at ``http://127.0.0.1:PORT/mcp``.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

MAX_READ_BYTES = 256 * 1024  # read from disk for one read_file
MAX_READ_CHARS = 12_000  # of which shown to the model
MAX_SCAN_BYTES = 1024 * 1024  # searched in one file
MAX_SCAN_FILES = 2_000  # files searched in one call
MAX_WALK_FILES = 10_000  # files listed (and offered) at most
MAX_HITS = 20
MAX_CHOICES = 200  # paths offered as a list to choose from
MAX_SEARCH_CHARS = 40
# No following the last component, and no blocking on a FIFO swapped in after the check.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
    | getattr(os, "O_BINARY", 0)


class OutsideFolder(ValueError):
    """A path this server does not read: outside its folder, hidden, through a symbolic
    link, or not a regular file."""


def _hidden(name: str) -> bool:
    return name.startswith(".")


@dataclass(frozen=True)
class FolderFile:
    path: Path
    relative: str
    size: int


class Folder:
    """The folder's files as this server sees them; every method takes plain text (the
    tools' arguments, whatever the schema said) and checks it here."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"{root} is not a folder")

    def resolve(self, relative: str) -> Path:
        """The path ``relative`` names, if this server may read it: relative, not hidden,
        no symbolic link on the way, inside the folder once resolved. Raises
        OutsideFolder (or FileNotFoundError)."""
        given = PurePath(relative)
        if given.is_absolute() or given.anchor:
            raise OutsideFolder(f"{relative!r} is not a path inside the folder (paths are "
                                "relative, as list_files gives them)")
        if ".." in given.parts:
            raise OutsideFolder(f"{relative!r} is outside the folder this server reads")
        if any(_hidden(part) for part in given.parts):
            raise OutsideFolder(f"{relative!r} is hidden: this server does not read hidden "
                                "files or folders")
        plain = self.root.joinpath(*given.parts)
        try:
            resolved = plain.resolve(strict=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"no file {relative!r} (list_files shows what there "
                                    "is)") from None
        except (OSError, RuntimeError) as exc:  # a loop of links, a name too long
            raise OutsideFolder(f"{relative!r} cannot be read here: {exc}") from None
        if not resolved.is_relative_to(self.root):
            raise OutsideFolder(f"{relative!r} is outside the folder this server reads")
        if resolved != plain:  # a symbolic link on the way, even one to inside
            raise OutsideFolder(f"{relative!r} goes through a symbolic link, which this "
                                "server does not follow")
        return resolved

    def files(self, base: Path | None = None, limit: int = MAX_WALK_FILES) -> list[FolderFile]:
        """The regular, visible files under ``base`` (the folder by default), by path, at
        most ``limit``: links to files or folders are not followed, hidden names skipped."""
        found: list[FolderFile] = []
        for path, size in self._walk(base or self.root):
            found.append(FolderFile(path, path.relative_to(self.root).as_posix(), size))
            if len(found) >= limit:
                break
        return sorted(found, key=lambda f: f.relative)

    def _walk(self, base: Path) -> Iterator[tuple[Path, int]]:
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            # os.walk lists a link to a folder among dirnames and, with followlinks=False,
            # does not enter it; hidden folders are pruned here.
            dirnames[:] = sorted(d for d in dirnames if not _hidden(d))
            for name in sorted(filenames):
                if _hidden(name):
                    continue
                path = Path(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):  # not a link, FIFO, socket or device
                    yield path, st.st_size

    def read_bytes(self, path: Path, max_bytes: int) -> tuple[bytes, int]:
        """The first ``max_bytes`` of the regular file ``path`` and its size. Checked
        before opening (a FIFO would block the open) and again on the open descriptor
        (a file swapped for a link or a FIFO after the check is refused)."""
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OutsideFolder(f"{path.relative_to(self.root).as_posix()!r} is not a "
                                "regular file")
        fd = os.open(path, _OPEN_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OutsideFolder(f"{path.relative_to(self.root).as_posix()!r} is not a "
                                    "regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(max_bytes), st.st_size
        finally:
            os.close(fd)

    # --- the tools ------------------------------------------------------------------------
    def list_files(self, folder: str = "") -> str:
        base = self.resolve(folder) if folder else self.root
        if not base.is_dir():
            raise NotADirectoryError(f"{folder!r} is not a folder")
        found = self.files(base)
        lines = [f"{f.relative} ({f.size} bytes)" for f in found]
        if len(found) >= MAX_WALK_FILES:
            lines.append(f"… (the first {MAX_WALK_FILES} files; there are more)")
        return "\n".join(lines) or "(no files)"

    def read_file(self, path: str) -> str:
        file = self.resolve(path)
        if file.is_dir():
            raise IsADirectoryError(f"{path!r} is a folder (list_files lists it)")
        data, size = self.read_bytes(file, MAX_READ_BYTES)
        text = data.decode("utf-8", errors="replace")
        if len(text) > MAX_READ_CHARS or size > len(data):
            text = text[:MAX_READ_CHARS]
            text += (f"\n… (truncated: the first {len(text)} characters of a file of "
                     f"{size} bytes)")
        return text

    def search_files(self, text: str) -> str:
        needle, hits = text.lower(), []
        files = self.files(limit=MAX_SCAN_FILES)
        for f in files:
            try:
                data, size = self.read_bytes(f.path, MAX_SCAN_BYTES)
            except (OSError, OutsideFolder):  # gone, unreadable or swapped since the walk
                continue
            lines = data.decode("utf-8", errors="replace").splitlines()
            for n, line in enumerate(lines, 1):
                if needle in line.lower():
                    hits.append(f"{f.relative}:{n}: {line.strip()}")
                    if len(hits) >= MAX_HITS:
                        return "\n".join(hits)
        if len(files) >= MAX_SCAN_FILES:
            hits.append(f"… (searched the first {MAX_SCAN_FILES} files only)")
        return "\n".join(hits) or f"no line contains {text!r}"


def _choice(values: list[str]) -> Any:
    """A parameter type that admits only ``values`` (a JSON schema enum, which holds a
    small model's arguments to what exists), or any text when there are too many."""
    return Literal[tuple(values)] if 0 < len(values) <= MAX_CHOICES else str


def make_server(root: Path) -> MCPServer:
    """The server over ``root``: its paths as a list the arguments choose from, taken
    when it starts (up to MAX_CHOICES files; past that any path is accepted by the schema,
    and Folder's checks decide, as they do for every call)."""
    reader = Folder(root)
    server = MCPServer("tandem-files",
                       instructions=f"Reads the text files under {reader.root}.")
    files = [f.relative for f in reader.files()]
    folders = sorted({PurePath(f).parent.as_posix() for f in files} - {"."})
    read_only = ToolAnnotations(read_only_hint=True)

    def list_files(folder: str = "") -> str:
        return reader.list_files(folder)

    def read_file(path: str) -> str:
        return reader.read_file(path)

    def search_files(text: str) -> str:
        return reader.search_files(text)

    list_files.__annotations__ = {"folder": _choice(["", *folders]) if folders else str,
                                  "return": str}
    read_file.__annotations__ = {"path": _choice(files), "return": str}
    search_files.__annotations__ = {
        "text": Annotated[str, Field(min_length=1, max_length=MAX_SEARCH_CHARS)],
        "return": str}
    server.add_tool(list_files, annotations=read_only,
                    description="List the files in the folder (or a subfolder), one path "
                                "a line with its size in bytes.")
    server.add_tool(read_file, annotations=read_only,
                    description="Read a text file of the folder, by its path as "
                                "list_files gives it.")
    server.add_tool(search_files, annotations=read_only,
                    description="Find the lines that contain a text (case-insensitive) "
                                "in the folder's files: path:line: text.")
    return server


def serve(server: MCPServer, http_port: int | None) -> None:
    if http_port is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=http_port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP")
    args = parser.parse_args(argv)
    serve(make_server(args.folder), args.http)


if __name__ == "__main__":
    main()
