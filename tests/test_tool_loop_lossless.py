"""Drafts through a tool loop: the calls and the tools' results in the prompt feed the
drafters that read the context, and every turn of the loop equals plain decoding's, with
drafts accepted and rejected (the bundled model, a real MCP server over files)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.benchmarks.tool_loop import TOOL_TASKS, make_tool_folder, run_loop
from app.tools.mcp_host import RUNNING, McpHost
from app.tools.server_config import ServerConfig
from engine.conversation import AnswerService
from engine.session import Engine, EngineConfig


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpHost]:
    folder = make_tool_folder(tmp_path_factory.mktemp("tool-loop") / "files")
    h = McpHost()
    h.start(ServerConfig("files", sys.executable, ("-m", "app.tools.files_server",
                                                   str(folder))))
    assert h.wait_started("files").state == RUNNING
    yield h
    h.close()


@pytest.mark.parametrize("drafter", ["memory", "lookup"])
def test_every_turn_of_a_tool_loop_equals_plain_decoding(
        host: McpHost, model_path: Path, tmp_path: Path, drafter: str) -> None:
    config = EngineConfig(model_path=model_path, drafter=drafter, n_threads=2,
                          memory_dir=tmp_path / "memory")
    engine = Engine(config)
    engine.pin_drafting()  # what is drafted must not follow this machine's load
    with AnswerService(engine, config) as service:
        proposed = accepted = after_calls = 0
        for question in TOOL_TASKS[:3]:
            plain = run_loop(service, host, question, rounds=2, max_tokens=40, plain=True)
            drafted = run_loop(service, host, question, rounds=2, max_tokens=40)
            assert drafted.texts == plain.texts, question
            assert [t.calls for t in drafted.turns] == [t.calls for t in plain.turns]
            assert any(t.calls for t in plain.turns)  # the loop called tools
            proposed += sum(t.n_proposed for t in drafted.turns)
            accepted += sum(t.n_accepted for t in drafted.turns)
            after_calls += sum(t.n_accepted for t in drafted.turns[1:])
    assert 0 < accepted < proposed  # drafts both kept and turned down
    assert after_calls > 0  # drafted from what the calls and results brought
