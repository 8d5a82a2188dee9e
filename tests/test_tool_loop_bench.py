"""The tool-loop bench's folder, server schema and table (the loop itself:
tests/test_tool_loop_lossless.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.benchmarks.tool_loop import (
    LoopRun,
    LoopTurn,
    _figures,
    format_tool_table,
    make_tool_folder,
)
from app.tools.files_server import make_server


def test_the_folder_and_the_servers_schema_hold_arguments_to_what_exists(
        tmp_path: Path) -> None:
    root = make_tool_folder(tmp_path / "files")
    assert "def dedent" in (root / "textwrap.py").read_text()
    tools = {t.name: t for t in asyncio.run(make_server(root).list_tools())}
    paths = tools["read_file"].input_schema["properties"]["path"]["enum"]
    assert sorted(paths) == ["config.py", "notes/harbour.md", "notes/lighthouse.md",
                             "textwrap.py", "timetable.csv"]
    assert tools["list_files"].input_schema["properties"]["folder"]["enum"] == ["", "notes"]
    assert tools["search_files"].input_schema["properties"]["text"]["maxLength"] == 40
    assert all(t.annotations.read_only_hint for t in tools.values())


def test_figures_and_table() -> None:
    call = {"tool": "read_file", "arguments": {"path": "a"}}
    plain = LoopRun([LoopTurn("c", 11, 1.0, 1.2, 1.0, calls=[call]),
                     LoopTurn("answer", 21, 2.0, 2.5, 1.0)])
    drafted = LoopRun([LoopTurn("c", 11, 0.5, 0.7, 2.0, 8, 5, calls=[call]),
                       LoopTurn("answer", 21, 1.0, 1.5, 2.0, 20, 10)])
    f = _figures([plain])
    assert (f["tok_per_s"], f["calls_tok_per_s"], f["answers_tok_per_s"]) == \
        (10.0, 10.0, 10.0)
    payload = {"runners": {"none": {**f, "identical": True},
                           "auto": {**_figures([drafted]), "identical": False}},
               "tasks": [{"question": "q", "turns": [],
                          "tok_per_s": {"none": 10.0, "auto": 20.0}}]}
    table = format_tool_table(payload)
    auto_row = next(line for line in table.splitlines() if line.startswith("auto"))
    assert "2.00x" in auto_row and auto_row.endswith("NO")
    assert "1: none 10.0, auto 20.0" in table
