"""The window's MCP servers: their list (kept in the app's settings), the host that runs
them (app.tools.mcp_host, its own thread) and Qt signals for what happens there.

Servers start with the app and stop with it. A call's result arrives as ``call_done`` in
the GUI thread; nothing here waits on a server.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.tools.mcp_host import FAILED, McpHost, ServerStatus, ToolCallError, ToolInfo, ToolOutcome
from app.tools.server_config import (
    ServerConfig,
    SettingsStore,
    load_servers,
    merged,
    read_mcp_json,
    save_servers,
)


class ToolServers(QObject):
    changed = Signal()  # the list, a server's state or its tools changed
    failed = Signal(str, str)  # a server's name and why it failed (to start, or later)
    call_done = Signal(object, object)  # key, ToolOutcome or ToolCallError
    _status = Signal(object)  # ServerStatus, from the host's thread
    _done = Signal(object, object)  # from the host's thread

    def __init__(self, store: SettingsStore, call_timeout_s: float = 120.0,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.configs: list[ServerConfig] = load_servers(store)
        self.host = McpHost(on_status=self._status.emit, call_timeout_s=call_timeout_s)
        self._calls: dict[object, Future] = {}
        self._status.connect(self._on_status)
        self._done.connect(self._finish)

    def _on_status(self, status: ServerStatus) -> None:
        if status.state == FAILED:
            self.failed.emit(status.name, status.message)
        self.changed.emit()

    # --- the list ------------------------------------------------------------------------
    def start_all(self) -> None:
        for config in self.configs:
            if config.enabled:
                self.host.start(config)

    def add(self, configs: list[ServerConfig]) -> None:
        """Add (or replace, by name) servers, save the list and start the enabled ones."""
        self.configs = merged(self.configs, configs)
        save_servers(self.store, self.configs)
        for config in configs:
            if config.enabled:
                self.host.start(config)
            else:
                self.host.stop(config.name)
        self.changed.emit()

    def import_file(self, path: Path) -> list[ServerConfig]:
        """The servers of an ``mcp.json`` added (a server of the same name replaced);
        raises ToolConfigError with why not. A file's ``alwaysAllow`` is not taken: only
        the user lets a tool run without asking, here."""
        found = [replace(c, always_allow=()) for c in read_mcp_json(path)]
        self.add(found)
        return found

    def remove(self, name: str) -> None:
        self.configs = [c for c in self.configs if c.name != name]
        save_servers(self.store, self.configs)
        self.host.stop(name)
        self.changed.emit()

    def restart(self, name: str) -> None:
        config = self.config(name)
        if config is not None:
            self.host.start(config)

    def config(self, name: str) -> ServerConfig | None:
        return next((c for c in self.configs if c.name == name), None)

    def status(self, name: str) -> ServerStatus:
        return self.host.status(name)

    def tools(self) -> list[ToolInfo]:
        """The running servers' tools, named as the model sees them."""
        return self.host.tools()

    # --- approvals -------------------------------------------------------------------------
    def always_allowed(self, server: str, tool: str) -> bool:
        config = self.config(server)
        return config is not None and tool in config.always_allow

    def allow_always(self, server: str, tool: str) -> None:
        config = self.config(server)
        if config is not None and tool not in config.always_allow:
            self.configs = [c.allowing(tool) if c.name == server else c
                            for c in self.configs]
            save_servers(self.store, self.configs)
            self.changed.emit()

    # --- calls -----------------------------------------------------------------------------
    def call(self, key: object, server: str, tool: str, arguments: dict) -> None:
        """Run a tool; ``call_done(key, outcome or error)`` follows in this thread."""
        future = self.host.call(server, tool, arguments)
        self._calls[key] = future
        future.add_done_callback(lambda f: None if f.cancelled() else self._done.emit(
            key, f.exception() or f.result()))

    def cancel(self, key: object) -> None:
        future = self._calls.pop(key, None)
        if future is not None:
            future.cancel()

    def _finish(self, key: object, outcome: ToolOutcome | ToolCallError) -> None:
        if self._calls.pop(key, None) is not None:
            if not isinstance(outcome, ToolOutcome | ToolCallError):
                outcome = ToolCallError(str(outcome))
            self.call_done.emit(key, outcome)

    def close(self) -> None:
        for key in list(self._calls):
            self.cancel(key)
        self.host.close()
