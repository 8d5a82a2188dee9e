"""The app as an MCP host: it starts the configured servers (a command over stdio, or a
URL over streamable HTTP) with the official ``mcp`` SDK's ``Client``, lists their tools and
runs calls, all on one asyncio loop in a thread of its own.

No Qt here: the window hears of a server's state through ``on_status`` (called on the
host's thread) and gets a call's result as a ``concurrent.futures.Future``, so no caller
ever waits on a server. A server that cannot start, or stops answering in the middle of a
call, is marked failed with why (the last lines it wrote on stderr for a command); the
call fails with a ``ToolCallError`` and the other servers go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import CONNECTION_CLOSED, REQUEST_TIMEOUT

from app.tools.server_config import ServerConfig
from engine.tool_calls import Tool

log = logging.getLogger(__name__)

STOPPED, STARTING, RUNNING, FAILED = "stopped", "starting", "running", "failed"
MAX_RESULT_CHARS = 32_000  # a result longer than this is cut (it goes into the context)
# Every offered tool's name, description and schema go into every prompt: a server cannot
# fill the context (or the screen) with them.
MAX_TOOLS_PER_SERVER = 64
MAX_DESCRIPTION_CHARS = 1_024
MAX_SCHEMA_CHARS = 8_000
STOP_GRACE_S = 6.0  # a server's time to end when stopped, before it is cancelled
_PUBLIC = re.compile(r"[^A-Za-z0-9_-]")


class ToolCallError(Exception):
    """A call that got no result: its server is gone, it took too long, or the server
    refused it (unknown tool, bad arguments). The message says which."""


@dataclass(frozen=True)
class ToolInfo:
    """A tool a running server offers; ``public_name`` is what the model calls it (the
    tool's own name, with the server's in front where two servers share it)."""

    server: str
    name: str
    description: str
    schema: dict
    public_name: str = ""

    def as_tool(self) -> Tool:
        """The tool as the engine offers it to the model."""
        return Tool(self.public_name or self.name, self.description,
                    self.schema or {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ServerStatus:
    name: str
    state: str  # STOPPED, STARTING, RUNNING or FAILED
    message: str = ""  # why it failed, or what it is doing
    tools: tuple[ToolInfo, ...] = ()


@dataclass(frozen=True)
class ToolOutcome:
    """A tool's result as text for the model; ``is_error``: the tool said it failed."""

    text: str
    is_error: bool = False


@dataclass
class _Job:
    tool: str
    arguments: dict
    future: Future
    task: asyncio.Task | None = None


@dataclass
class _Server:
    config: ServerConfig
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    status: ServerStatus | None = None


def result_text(result: Any) -> ToolOutcome:
    """A ``CallToolResult`` as the text the model reads back."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind or 'content'}: {getattr(block, 'mime_type', '')}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n… ({len(text) - MAX_RESULT_CHARS:,} more " \
                                          "characters cut)"
    return ToolOutcome(text, bool(result.is_error))


def public_names(tools: list[ToolInfo]) -> list[ToolInfo]:
    """``tools`` with the names the model sees: unique, and within what tool syntaxes
    accept (letters, digits, ``_``, ``-``; 64 at most)."""
    def clean(name: str) -> str:
        return _PUBLIC.sub("_", name)[:64]

    count: dict[str, int] = {}
    for t in tools:
        count[clean(t.name)] = count.get(clean(t.name), 0) + 1
    out, taken = [], set()
    for t in tools:
        name = clean(t.name if count[clean(t.name)] == 1 else f"{t.server}_{t.name}")
        base, n = name, 2
        while name in taken:  # still shared (names alike once cleaned, or cut at 64)
            name = f"{base[:60]}_{n}"
            n += 1
        taken.add(name)
        out.append(ToolInfo(t.server, t.name, t.description, t.schema, name))
    return out


class McpHost:
    """Starts, watches and stops MCP servers; runs their tools. Thread-safe; ``close()``
    stops every server (their processes end with it)."""

    def __init__(self, on_status: Callable[[ServerStatus], None] | None = None,
                 call_timeout_s: float = 120.0, start_timeout_s: float = 30.0) -> None:
        self.on_status = on_status or (lambda _s: None)
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._servers: dict[str, _Server] = {}
        self._starting: dict[str, int] = {}  # starts asked for and not begun, by name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-mcp",
                                        daemon=True)
        self._thread.start()
        self._closed = False

    # --- called from any thread ----------------------------------------------------------
    def start(self, config: ServerConfig) -> None:
        """Start ``config``'s server (stopping one of the same name first); returns at once,
        its state comes through ``on_status``."""
        with self._lock:  # STARTING from now on, not the state of the one it replaces
            self._starting[config.name] = self._starting.get(config.name, 0) + 1
        self._post(self._start(config))

    def stop(self, name: str) -> None:
        self._post(self._stop(name))

    def status(self, name: str) -> ServerStatus:
        with self._lock:
            if self._starting.get(name):
                return ServerStatus(name, STARTING, "starting")
            rec = self._servers.get(name)
            return rec.status if rec is not None and rec.status is not None \
                else ServerStatus(name, STOPPED)

    def statuses(self) -> list[ServerStatus]:
        with self._lock:
            return [r.status for r in self._servers.values() if r.status is not None]

    def tools(self) -> list[ToolInfo]:
        """Every running server's tools, with the names the model sees."""
        found = [t for s in self.statuses() if s.state == RUNNING for t in s.tools]
        return public_names(found)

    def wait_started(self, name: str, timeout_s: float = 60.0) -> ServerStatus:
        """Block until ``name`` runs or failed, or ``timeout_s`` passed (for the CLI, the
        bench and tests; a restart passes through STOPPED, which is not an outcome)."""
        deadline = time.monotonic() + timeout_s
        while self.status(name).state not in (RUNNING, FAILED) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        return self.status(name)

    def call(self, server: str, tool: str, arguments: dict) -> Future:
        """Run ``tool`` of ``server``: a Future of a ToolOutcome, or of a ToolCallError.
        ``Future.cancel()`` abandons the call (its task is cancelled; a queued one never
        runs)."""
        future: Future = Future()  # left pending, so that cancel() works while it runs
        job = _Job(tool, dict(arguments), future)
        future.add_done_callback(lambda f: self._abandon(job) if f.cancelled() else None)
        self._post(self._enqueue(server, job))
        return future

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every server (at once, each given STOP_GRACE_S) and the host's thread;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._stop_all(), self._loop).result(timeout_s)
        except Exception as exc:  # noqa: BLE001 - closing goes on whatever a server did
            log.warning("stopping MCP servers: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(2.0)

    # --- the host's loop ---------------------------------------------------------------------
    def _post(self, coro: Any) -> None:
        if self._closed:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _set(self, rec: _Server, state: str, message: str = "",
             tools: tuple[ToolInfo, ...] = ()) -> None:
        status = ServerStatus(rec.config.name, state, message, tools)
        with self._lock:
            rec.status = status
        try:
            self.on_status(status)
        except Exception:  # a listener's bug must not stop the server
            log.exception("MCP status listener failed")

    async def _start(self, config: ServerConfig) -> None:
        await self._stop(config.name)
        while config.name in self._servers:  # another start of it ran while this waited
            await self._stop(config.name)
        rec = _Server(config)
        with self._lock:
            self._servers[config.name] = rec
            self._starting[config.name] -= 1
        self._set(rec, STARTING, f"starting {config.where()}")
        rec.task = asyncio.create_task(self._serve(rec))

    async def _stop(self, name: str) -> None:
        with self._lock:
            rec = self._servers.pop(name, None)
        if rec is None or rec.task is None:
            return
        rec.queue.put_nowait(None)
        # The SDK ends a command by closing its stdin, then SIGTERM, then SIGKILL (about
        # 2 s each); one stuck before it started is cancelled, which does the same.
        done, _ = await asyncio.wait([rec.task], timeout=STOP_GRACE_S)
        if not done:
            rec.task.cancel()
            await asyncio.wait([rec.task], timeout=STOP_GRACE_S)
        self._set(rec, STOPPED, "stopped")

    async def _stop_all(self) -> None:
        with self._lock:
            names = list(self._servers)
        await asyncio.gather(*(self._stop(name) for name in names), return_exceptions=True)

    async def _enqueue(self, server: str, job: _Job) -> None:
        with self._lock:
            rec = self._servers.get(server)
        state = rec.status.state if rec is not None and rec.status is not None else STOPPED
        if rec is None or state not in (RUNNING, STARTING):
            why = rec.status.message if rec is not None and rec.status else "not started"
            _fail(job, ToolCallError(f"the tool server {server!r} is not running ({why})"))
            return
        rec.queue.put_nowait(job)

    def _abandon(self, job: _Job) -> None:
        task = job.task
        if task is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    async def _serve(self, rec: _Server) -> None:
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
            await self._serve_logging(rec, errlog)

    async def _serve_logging(self, rec: _Server, errlog: Any) -> None:
        config = rec.config
        # A command's stderr goes to a file: its last lines say why it failed.
        target: Any = config.url or stdio_client(StdioServerParameters(
            command=config.command, args=list(config.args), env=dict(config.env) or None),
            errlog=errlog)
        calls: set[asyncio.Task] = set()
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    Client(target, read_timeout_seconds=self.start_timeout_s))
                offered = await _list_tools(client, config.name)
                tools, note = bounded_tools(offered)
                self._set(rec, RUNNING, f"{len(tools)} tools{note}", tools)
                while True:
                    job = await rec.queue.get()
                    if job is None or job is _GONE:
                        break
                    if job.future.done():  # abandoned while it waited: never run
                        continue
                    job.task = asyncio.create_task(self._call(rec, client, job))
                    calls.add(job.task)
                    job.task.add_done_callback(calls.discard)
                for task in list(calls):
                    task.cancel()
                if job is _GONE:
                    raise ToolCallError(rec.status.message if rec.status else "stopped")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - ExceptionGroups from task groups
            if rec.status is not None and rec.status.state == FAILED:
                return  # a call found it gone and said why; closing it failed too
            why = _reason(exc)
            started = rec.status is not None and rec.status.state != STARTING
            if not started:  # why it could not start, in its own words where it said
                tail = _tail(errlog)
                why = f"could not start ({why}){': ' + tail if tail else ''}"
            self._set(rec, FAILED, why)
        else:
            if rec.status is not None and rec.status.state != FAILED:
                self._set(rec, STOPPED, "stopped")
        finally:
            while not rec.queue.empty():
                left = rec.queue.get_nowait()
                if isinstance(left, _Job):
                    _fail(left, ToolCallError(f"the tool server {config.name!r} stopped"))

    async def _call(self, rec: _Server, client: Client, job: _Job) -> None:
        try:
            result = await client.call_tool(job.tool, job.arguments,
                                            read_timeout_seconds=self.call_timeout_s)
        except asyncio.CancelledError:
            # Abandoned (its future is cancelled already), or its server stopped.
            _fail(job, ToolCallError(f"the tool server {rec.config.name!r} stopped "
                                     f"during {job.tool}"))
            raise
        except Exception as exc:  # noqa: BLE001 - told to the caller
            if not _connection_lost(exc):
                why = f"took longer than {self.call_timeout_s:.0f} s" \
                    if isinstance(exc, MCPError) and exc.code == REQUEST_TIMEOUT \
                    else _reason(exc)
                _fail(job, ToolCallError(f"{job.tool} on {rec.config.name}: {why}"))
                return
            why = f"stopped answering during {job.tool} ({_reason(exc)})"
            self._set(rec, FAILED, why)
            rec.queue.put_nowait(_GONE)
            _fail(job, ToolCallError(f"the tool server {rec.config.name!r} {why}"))
            return
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            job.future.set_result(result_text(result))


_GONE: Any = object()  # queued when a call found its server gone: the serve loop ends


def _fail(job: _Job, exc: Exception) -> None:
    with contextlib.suppress(InvalidStateError):  # done, or cancelled meanwhile
        job.future.set_exception(exc)


def _connection_lost(exc: BaseException) -> bool:
    """Whether a failed call means the server is gone (its process ended, its HTTP
    endpoint went away) rather than that it refused this call."""
    if isinstance(exc, MCPError):
        return exc.code == CONNECTION_CLOSED
    return isinstance(exc, (anyio.ClosedResourceError, anyio.BrokenResourceError,
                            anyio.EndOfStream, OSError))


async def _list_tools(client: Client, server: str) -> tuple[ToolInfo, ...]:
    tools: list[ToolInfo] = []
    cursor = None
    for _ in range(100):  # a server that pages forever cannot hang the start
        page = await client.list_tools(cursor=cursor)
        tools += [ToolInfo(server, t.name, t.description or "",
                           dict(t.input_schema or {"type": "object", "properties": {}}))
                  for t in page.tools]
        cursor = page.next_cursor
        if not cursor:
            break
    return tuple(tools)


def bounded_tools(tools: tuple[ToolInfo, ...]) -> tuple[tuple[ToolInfo, ...], str]:
    """At most MAX_TOOLS_PER_SERVER tools, each description cut to MAX_DESCRIPTION_CHARS;
    a tool whose schema is larger than MAX_SCHEMA_CHARS is left out. The note says what
    was left out (empty when nothing was)."""
    kept: list[ToolInfo] = []
    too_large = 0
    for tool in tools:
        if len(json.dumps(tool.schema, ensure_ascii=False)) > MAX_SCHEMA_CHARS:
            too_large += 1
            continue
        if len(tool.description) > MAX_DESCRIPTION_CHARS:
            tool = replace(tool, description=tool.description[:MAX_DESCRIPTION_CHARS] + "…")
        kept.append(tool)
    extra = max(0, len(kept) - MAX_TOOLS_PER_SERVER)
    notes = []
    if extra:
        notes.append(f"{extra} more left out (at most {MAX_TOOLS_PER_SERVER})")
    if too_large:
        notes.append(f"{too_large} with a schema over {MAX_SCHEMA_CHARS:,} characters "
                     "left out")
    return tuple(kept[:MAX_TOOLS_PER_SERVER]), "; " + "; ".join(notes) if notes else ""


def _reason(exc: BaseException) -> str:
    """The innermost message of ``exc`` (task groups wrap what failed)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError):
        return exc.error.message
    if isinstance(exc, FileNotFoundError):
        return f"command not found: {exc.filename or exc}"
    text = str(exc).strip()
    return text or type(exc).__name__


def _tail(errlog: Any, n_lines: int = 3) -> str:
    try:
        errlog.flush()
        errlog.seek(0)
        lines = [line.strip() for line in errlog.read().splitlines() if line.strip()]
    except (OSError, ValueError):
        return ""
    return " / ".join(lines[-n_lines:])[-400:]
