"""A small MCP server over one folder: list, read and search its text files, nothing
outside it, nothing written. The tool-loop benchmark drives it, the tests too, and a user
can add it to try tools (Settings > Tools > Add: ``python -m app.tools.files_server
FOLDER``).

``python -m app.tools.files_server FOLDER`` speaks stdio; ``--http PORT`` serves
streamable HTTP at ``http://127.0.0.1:PORT/mcp``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

MAX_READ_CHARS = 12_000
MAX_HITS = 20
MAX_CHOICES = 200  # paths offered as a list to choose from
MAX_SEARCH_CHARS = 40


class OutsideFolder(ValueError):
    pass


def _inside(root: Path, relative: str) -> Path:
    path = (root / relative).resolve()
    if path != root and root not in path.parents:
        raise OutsideFolder(f"{relative!r} is outside the folder this server reads")
    return path


def _text_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _choice(values: list[str]) -> Any:
    """A parameter type that admits only ``values`` (a JSON schema enum, which holds a
    small model's arguments to what exists), or any text when there are too many."""
    return Literal[tuple(values)] if 0 < len(values) <= MAX_CHOICES else str


def make_server(root: Path) -> MCPServer:
    """The server over ``root``: its paths as a list the arguments choose from, taken
    when it starts (up to MAX_CHOICES files; past that any path is accepted)."""
    root = Path(root).resolve()
    server = MCPServer("tandem-files", instructions=f"Reads the text files under {root}.")
    files = [str(p.relative_to(root)) for p in _text_files(root)]
    folders = sorted({str(Path(f).parent) for f in files} - {"."})
    read_only = ToolAnnotations(read_only_hint=True)

    def list_files(folder: str = "") -> str:
        base = _inside(root, folder)
        lines = [f"{p.relative_to(root)} ({p.stat().st_size} bytes)"
                 for p in _text_files(base)]
        return "\n".join(lines) or "(no files)"

    def read_file(path: str) -> str:
        file = _inside(root, path)
        if not file.is_file():
            raise FileNotFoundError(f"no file {path!r} (list_files shows what there is)")
        text = file.read_text(encoding="utf-8", errors="replace")
        if len(text) > MAX_READ_CHARS:
            text = text[:MAX_READ_CHARS] + f"\n… ({len(text) - MAX_READ_CHARS} more characters)"
        return text

    def search_files(text: str) -> str:
        needle, hits = text.lower(), []
        for p in _text_files(root):
            for n, line in enumerate(p.read_text(encoding="utf-8",
                                                 errors="replace").splitlines(), 1):
                if needle in line.lower():
                    hits.append(f"{p.relative_to(root)}:{n}: {line.strip()}")
                    if len(hits) >= MAX_HITS:
                        return "\n".join(hits)
        return "\n".join(hits) or f"no line contains {text!r}"

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
