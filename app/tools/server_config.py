"""Which MCP servers the app starts: by command (stdio) or by URL (streamable HTTP), as
Claude Desktop's and LM Studio's ``mcp.json`` write them.

``{"mcpServers": {"files": {"command": "uvx", "args": [...], "env": {...}},
"web": {"url": "http://localhost:8000/mcp"}}}``; an entry may say ``"disabled": true``,
and ``"alwaysAllow": [tool names]`` (Cline's key) lists the tools the user let run without
asking. VS Code's ``{"servers": {...}}`` reads the same way. The app keeps its own list in
the same shape (app settings, key ``mcp_servers``), so importing is a merge.

``"tandemApproved": true`` is the app's own mark that the user saw this exact server
(command, arguments, environment or URL) and said yes to starting it: only such a server
starts, and only the app's settings carry the mark (an imported file's is dropped).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

SETTINGS_KEY = "mcp_servers"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")


class ToolConfigError(ValueError):
    """An ``mcp.json`` or a server entry the app cannot use; the message says why."""


@dataclass(frozen=True)
class ServerConfig:
    """One server: ``command`` (with ``args``, ``env``) or ``url``, never both."""

    name: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    enabled: bool = True
    always_allow: tuple[str, ...] = ()  # tools that run without asking
    approved: bool = False  # the user saw this server and said yes to starting it

    @property
    def starts(self) -> bool:
        """Whether the app may start it: the user said yes and has not turned it off."""
        return self.enabled and self.approved

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def where(self) -> str:
        """The command line or URL, for the settings list."""
        return self.url or " ".join([self.command, *self.args])

    def allowing(self, tool: str) -> ServerConfig:
        return self if tool in self.always_allow else \
            replace(self, always_allow=(*self.always_allow, tool))

    def to_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"url": self.url} if self.url else {
            "command": self.command, "args": list(self.args)}
        if self.env:
            entry["env"] = dict(self.env)
        if not self.enabled:
            entry["disabled"] = True
        if self.always_allow:
            entry["alwaysAllow"] = list(self.always_allow)
        if self.approved:
            entry["tandemApproved"] = True
        return entry


def server_from_entry(name: str, entry: Any) -> ServerConfig:
    """A server from one ``mcpServers`` entry; ToolConfigError naming what is wrong."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolConfigError(f"server name {name!r}: use 1-48 letters, digits, '.', '_' "
                              "or '-'")
    if not isinstance(entry, dict):
        raise ToolConfigError(f"server {name!r}: expected an object with a command or a url")
    url, command = entry.get("url") or entry.get("serverUrl"), entry.get("command")
    if bool(url) == bool(command):
        raise ToolConfigError(f"server {name!r}: give either a command or a url")
    args = entry.get("args", [])
    env = entry.get("env", {})
    allow = entry.get("alwaysAllow", [])
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ToolConfigError(f"server {name!r}: args must be a list of strings")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ToolConfigError(f"server {name!r}: env must map names to strings")
    if not (isinstance(allow, list) and all(isinstance(a, str) for a in allow)):
        raise ToolConfigError(f"server {name!r}: alwaysAllow must be a list of tool names")
    if url and not (isinstance(url, str) and re.match(r"^https?://", url)):
        raise ToolConfigError(f"server {name!r}: the url must start with http:// or https://")
    if command and not isinstance(command, str):
        raise ToolConfigError(f"server {name!r}: the command must be a string")
    return ServerConfig(name, command or "", tuple(args), tuple(sorted(env.items())),
                        url or "", not entry.get("disabled", False), tuple(allow),
                        entry.get("tandemApproved") is True)


def servers_from_json(data: Any) -> list[ServerConfig]:
    """The servers of an ``mcp.json``'s parsed content."""
    entries = data.get("mcpServers", data.get("servers")) if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ToolConfigError('expected {"mcpServers": {name: {command, args} or {url}}}')
    return [server_from_entry(name, entry) for name, entry in entries.items()]


MAX_MCP_JSON_BYTES = 1 << 20  # a hand-written server list is a few kB


def read_mcp_json(path: Path) -> list[ServerConfig]:
    """The servers an ``mcp.json`` file lists, as the file says them: nothing in it is
    taken as the user's yes (``alwaysAllow`` and ``tandemApproved`` are dropped).
    ToolConfigError when it cannot be read."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ToolConfigError(f"{Path(path).name} is not a regular file")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_MCP_JSON_BYTES + 1)
        if len(raw) > MAX_MCP_JSON_BYTES:
            raise ToolConfigError(f"{Path(path).name} is larger than 1 MB: not a server list")
        data = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ToolConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ToolConfigError(f"{Path(path).name} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ToolConfigError(f"{Path(path).name} nests too deeply: not a server list"
                              ) from None
    return [replace(c, always_allow=(), approved=False) for c in servers_from_json(data)]


def to_json(servers: list[ServerConfig]) -> dict[str, Any]:
    return {"mcpServers": {s.name: s.to_entry() for s in servers}}


def merged(current: list[ServerConfig], added: list[ServerConfig]) -> list[ServerConfig]:
    """``current`` with ``added`` in: a server of the same name is replaced."""
    names = {s.name for s in added}
    return [s for s in current if s.name not in names] + list(added)


class SettingsStore(Protocol):
    def get_setting(self, key: str, default: object = None) -> object: ...

    def set_setting(self, key: str, value: object) -> None: ...


def load_servers(store: SettingsStore) -> list[ServerConfig]:
    """The servers kept in the app's settings (none when never set or unreadable)."""
    try:
        return servers_from_json(store.get_setting(SETTINGS_KEY, {"mcpServers": {}}))
    except ToolConfigError:
        return []


def save_servers(store: SettingsStore, servers: list[ServerConfig]) -> None:
    store.set_setting(SETTINGS_KEY, to_json(servers))

