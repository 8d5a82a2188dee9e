"""The tests' MCP server: the files server's tools plus tools that misbehave on purpose
(a tool that fails, one that kills its server, a slow one) and one with a side effect.

``python tests/mcp_servers/trouble_server.py FOLDER [--http PORT]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.tools.files_server import make_server, serve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--http", type=int)
    parser.add_argument("--only", help="offer only these tools (comma-separated)")
    args = parser.parse_args()
    server = make_server(args.folder)
    counter = args.folder / ".count"

    @server.tool(description="Always fails.")
    def broken() -> str:
        raise RuntimeError("broken failed, as it always does")

    @server.tool(description="Ends this server's process at once.")
    def crash() -> str:
        print("crash: exiting now", file=sys.stderr, flush=True)
        os._exit(3)

    @server.tool(description="Waits some seconds, then says so.")
    def slow(seconds: float = 30.0) -> str:
        time.sleep(seconds)
        return f"waited {seconds} s"

    @server.tool(description="Adds one to a counter and returns it.")
    def bump() -> str:
        n = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(n))
        return f"count is {n}"

    if args.only:
        keep = set(args.only.split(","))
        for name in [t.name for t in server._tool_manager.list_tools()]:
            if name not in keep:
                server.remove_tool(name)
    serve(server, args.http)


if __name__ == "__main__":
    main()
