"""The window's MCP servers: their list (kept in the app's settings), the host that runs
them (app.tools.mcp_host, its own thread) and Qt signals for what happens there.

Starting a server runs a program (or talks to a URL), so it is the user's decision: a
server added or imported here is first only *reviewed* (app.tools.server_review), and
starts once the user said yes (``add``); at app start only the servers the user approved
and left on start. They stop with the app. A call's result arrives as ``call_done`` in the
GUI thread; nothing here waits on a server.
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
from app.tools.server_review import ServerReview, reviews


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
        """The servers the user approved and left on (at app start)."""
        for config in self.configs:
            if config.starts:
                self.host.start(config)

    def review(self, configs: list[ServerConfig]) -> list[ServerReview]:
        """What adding ``configs`` would start and replace; changes nothing."""
        return reviews(configs, self.configs)

    def add(self, configs: list[ServerConfig]) -> None:
        """The servers the user reviewed and said yes to: saved as approved (a server of
        the same name replaced) and started."""
        approved = [replace(c, enabled=True, approved=True) for c in configs]
        self.configs = merged(self.configs, approved)
        save_servers(self.store, self.configs)
        for config in approved:
            self.host.start(config)
        self.changed.emit()

    def read_import(self, path: Path) -> list[ServerReview]:
        """The servers of an ``mcp.json``, reviewed and not yet added: nothing starts and
        nothing is replaced until ``add`` gets the user's choice. Raises ToolConfigError
        with why the file cannot be used. A file's ``alwaysAllow`` is not taken: only the
        user lets a tool run without asking, here."""
        return self.review(read_mcp_json(path))

    def turn_off(self, name: str) -> None:
        """Stopped, and not started with the app until the user turns it on again."""
        config = self.config(name)
        if config is not None:
            self.configs = [replace(c, enabled=False) if c.name == name else c
                            for c in self.configs]
            save_servers(self.store, self.configs)
            self.host.stop(name)
            self.changed.emit()

    def remove(self, name: str) -> None:
        self.configs = [c for c in self.configs if c.name != name]
        save_servers(self.store, self.configs)
        self.host.stop(name)
        self.changed.emit()

    def restart(self, name: str) -> None:
        """Starts again a server the user approved (one not approved needs ``add``)."""
        config = self.config(name)
        if config is not None and config.approved:
            if not config.enabled:
                self.configs = [replace(c, enabled=True) if c.name == name else c
                                for c in self.configs]
                save_servers(self.store, self.configs)
            self.host.start(replace(config, enabled=True))
            self.changed.emit()

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
