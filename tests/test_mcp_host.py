"""The MCP host against real servers written with the SDK (tests/mcp_servers): over
stdio and streamable HTTP, tools listed and called, a tool that fails, a server that dies
mid-call, one that cannot start, a call abandoned; and mcp.json lists."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.tools.mcp_host import (
    FAILED,
    RUNNING,
    McpHost,
    ToolCallError,
    ToolInfo,
    ToolOutcome,
    public_names,
)
from app.tools.server_config import (
    ServerConfig,
    ToolConfigError,
    load_servers,
    merged,
    read_mcp_json,
    save_servers,
    servers_from_json,
)
from app.tools.turns import (
    DONE,
    REFUSED,
    REPLAYED,
    expand,
    new_call,
    replayable,
    rounds_since_user,
)

SERVER = Path(__file__).parent / "mcp_servers" / "trouble_server.py"


def trouble(folder: Path, name: str = "t", only: str = "") -> ServerConfig:
    args = [str(SERVER), str(folder)] + (["--only", only] if only else [])
    return ServerConfig(name, sys.executable, tuple(args))


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "files"
    (root / "notes").mkdir(parents=True)
    (root / "a.txt").write_text("The harbour opens at six.\n")
    (root / "notes" / "b.md").write_text("# Ferry\nThe ferry leaves at nine.\n")
    return root


@pytest.fixture()
def host() -> Iterator[McpHost]:
    h = McpHost(call_timeout_s=20)
    yield h
    h.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stdio_server_lists_and_runs_tools(host: McpHost, folder: Path) -> None:
    host.start(trouble(folder))
    status = host.wait_started("t")
    assert status.state == RUNNING, status.message
    assert {t.name for t in status.tools} >= {"list_files", "read_file", "search_files"}
    listing = host.call("t", "list_files", {}).result(20)
    assert "a.txt" in listing.text and "notes/b.md" in listing.text
    assert host.call("t", "read_file", {"path": "notes/b.md"}).result(20) == \
        ToolOutcome("# Ferry\nThe ferry leaves at nine.\n", False)
    assert "b.md:2:" in host.call("t", "search_files", {"text": "FERRY L"}).result(20).text
    # Outside its folder the server refuses (as a tool error the model can read).
    outside = host.call("t", "read_file", {"path": "../../etc/passwd"}).result(20)
    assert outside.is_error


def test_a_failing_tool_is_an_error_result_and_the_server_stays(host: McpHost,
                                                                 folder: Path) -> None:
    host.start(trouble(folder))
    assert host.wait_started("t").state == RUNNING
    failed = host.call("t", "broken", {}).result(20)
    assert failed.is_error and "broken" in failed.text
    unknown = host.call("t", "no_such_tool", {}).result(20)
    assert unknown.is_error
    assert host.call("t", "bump", {}).result(20).text == "count is 1"
    assert host.status("t").state == RUNNING


def test_a_server_that_dies_mid_call_fails_the_call_and_says_so(host: McpHost,
                                                                folder: Path) -> None:
    host.start(trouble(folder))
    assert host.wait_started("t").state == RUNNING
    with pytest.raises(ToolCallError, match="stopped answering during crash"):
        host.call("t", "crash", {}).result(20)
    assert host.status("t").state == FAILED
    with pytest.raises(ToolCallError, match="not running"):
        host.call("t", "bump", {}).result(20)
    # A restart brings it back.
    host.start(trouble(folder))
    assert host.wait_started("t").state == RUNNING
    assert host.call("t", "bump", {}).result(20).text == "count is 1"


def test_servers_that_cannot_start_say_why(host: McpHost, tmp_path: Path) -> None:
    host.start(ServerConfig("missing", str(tmp_path / "no-such-command")))
    status = host.wait_started("missing")
    assert status.state == FAILED and "could not start" in status.message
    host.start(ServerConfig("quits", sys.executable, (
        "-c", "import sys; print('needs an API key', file=sys.stderr); sys.exit(2)")))
    status = host.wait_started("quits")
    assert status.state == FAILED and "needs an API key" in status.message
    host.start(ServerConfig("nobody", url=f"http://127.0.0.1:{_port()}/mcp"))
    assert host.wait_started("nobody").state == FAILED
    with pytest.raises(ToolCallError, match="not running"):
        host.call("nobody", "x", {}).result(20)


def test_an_abandoned_call_is_cancelled_and_the_server_goes_on(host: McpHost,
                                                               folder: Path) -> None:
    host.start(trouble(folder))
    assert host.wait_started("t").state == RUNNING
    slow = host.call("t", "slow", {"seconds": 30})
    time.sleep(0.3)
    t0 = time.monotonic()
    assert slow.cancel()
    assert host.call("t", "bump", {}).result(20).text == "count is 1"
    assert time.monotonic() - t0 < 20  # (not waiting for the slow tool's 30 s)


def test_http_server(host: McpHost, folder: Path) -> None:
    port = _port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(folder), "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        for _ in range(100):  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        host.start(ServerConfig("web", url=url))
        assert host.wait_started("web").state == RUNNING
        assert "harbour" in host.call("web", "read_file", {"path": "a.txt"}).result(20).text
        proc.kill()
        proc.wait()
        with pytest.raises(ToolCallError):
            host.call("web", "read_file", {"path": "a.txt"}).result(30)
        assert host.status("web").state == FAILED
    finally:
        proc.kill()


def test_mcp_json_reads_as_claude_desktop_and_lm_studio_write_it(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server-filesystem", "/home/me"],
                  "env": {"TOKEN": "x"}},
        "web": {"url": "http://localhost:8000/mcp", "alwaysAllow": ["fetch"]},
        "off": {"command": "uvx", "args": ["thing"], "disabled": True}}}))
    files, web, off = read_mcp_json(path)
    assert (files.command, files.args, dict(files.env)) == \
        ("npx", ("-y", "server-filesystem", "/home/me"), {"TOKEN": "x"})
    # A file's alwaysAllow (and any approval) is not the user's: read_mcp_json drops it.
    assert (web.url, web.always_allow, web.transport) == ("http://localhost:8000/mcp", (),
                                                          "http")
    assert not off.enabled and not any(s.approved for s in (files, web, off))
    web = servers_from_json({"mcpServers": {"web": {"url": "http://localhost:8000/mcp",
                                                    "alwaysAllow": ["fetch"]}}})[0]
    assert web.always_allow == ("fetch",)  # the app's own list keeps what the user allowed
    # VS Code's "servers" key reads the same way; a round trip keeps everything.
    assert servers_from_json({"servers": {"w": {"url": "https://x/mcp"}}})[0].url
    store = _Settings()
    save_servers(store, [files, web, off])
    assert load_servers(store) == [files, web, off]
    assert [s.name for s in merged([files, web], [ServerConfig("files", "other")])] == \
        ["web", "files"]


@pytest.mark.parametrize("text, why", [
    ("{", "not valid JSON"),
    ('{"servers": 3}', "expected"),
    ('{"mcpServers": {"a b": {"command": "x"}}}', "server name"),
    ('{"mcpServers": {"x": {"command": "x", "url": "http://y"}}}', "either a command"),
    ('{"mcpServers": {"x": {"url": "ftp://y"}}}', "http"),
    ('{"mcpServers": {"x": {"command": "x", "args": "-v"}}}', "args"),
])
def test_bad_mcp_json_says_what_is_wrong(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(text)
    with pytest.raises(ToolConfigError, match=why):
        read_mcp_json(path)
    with pytest.raises(ToolConfigError, match="cannot read"):
        read_mcp_json(tmp_path / "missing.json")


def test_public_names_are_unique_and_valid() -> None:
    tools = [ToolInfo("a", "read", "", {}), ToolInfo("b", "read", "", {}),
             ToolInfo("c.d", "x y", "", {})]
    assert [t.public_name for t in public_names(tools)] == ["a_read", "b_read", "x_y"]


def test_turns_expand_calls_for_the_model_and_replay_only_earlier_results() -> None:
    first = new_call(5, 0, "read_file", "files", "read_file", {"path": "a.txt"})
    first.update(state=DONE, result="hello")
    refused = new_call(5, 1, "bump", "t", "bump", {})
    refused.update(state=REFUSED)
    messages = expand("assistant", "", {"tool_calls": [first, refused]})
    assert messages[0]["tool_calls"][0] == {"id": "call_5_0", "name": "read_file",
                                            "arguments": {"path": "a.txt"}}
    assert [m["content"] for m in messages[1:]] == ["hello",
                                                    "The user did not allow this call."]
    assert set(replayable([first, refused], before_message=6)) == {
        '["files","read_file",{"path":"a.txt"}]'}
    assert replayable([first], before_message=5) == {}  # the loop does not replay itself
    failed = dict(first, is_error=True)
    assert replayable([failed], before_message=6) == {}
    replayed = dict(first, state=REPLAYED)
    assert replayable([replayed], before_message=9)
    infos = [("user", {}), ("assistant", {"tool_calls": [first]}),
             ("assistant", {"tool_calls": [refused]})]
    assert rounds_since_user(infos) == 2
    assert rounds_since_user([*infos, ("assistant", {})]) == 0


class _Settings:
    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def get_setting(self, key: str, default: object = None) -> object:
        return json.loads(json.dumps(self.values.get(key, default)))

    def set_setting(self, key: str, value: object) -> None:
        self.values[key] = value


def test_stopping_a_server_fails_its_running_call_and_a_double_restart_leaves_one(
        host: McpHost, folder: Path) -> None:
    host.start(trouble(folder))
    assert host.wait_started("t").state == RUNNING
    slow = host.call("t", "slow", {"seconds": 30})
    time.sleep(0.3)
    host.stop("t")
    with pytest.raises(ToolCallError, match="stopped"):
        slow.result(20)
    host.start(trouble(folder))
    host.start(trouble(folder))  # a second Restart before the first one finished
    assert host.wait_started("t").state == RUNNING
    time.sleep(1.0)
    assert len(host._servers) == 1 and host.status("t").state == RUNNING
    assert host.call("t", "bump", {}).result(20).text == "count is 1"
