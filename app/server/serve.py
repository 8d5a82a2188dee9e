"""Serving the OpenAI-compatible API with uvicorn: in the foreground (``tandem serve``)
or on a thread beside the desktop app. Bound to 127.0.0.1 unless told otherwise, and
another address only with an API key."""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

import uvicorn

from app.server.http_api import ServerState, make_app
from app.server.lane import EngineLane
from app.server.parallel_lane import ParallelEngineLane, lanes_allowed
from app.server.schema import Limits
from engine.conversation import AnswerService
from engine.decoding.generation import GenerationResult

DEFAULT_PORT = 8080
DEFAULT_QUEUE = 8


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_binding(host: str, port: int, api_key: str | None) -> None:
    """Raise ValueError for a port out of range, or an address other machines can reach
    without an API key."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    if not is_loopback(host) and not api_key:
        raise ValueError(f"--host {host} lets other machines use the model: give --api-key "
                         "KEY too (clients then send 'Authorization: Bearer KEY')")
    if api_key is not None and len(api_key) < 8:
        raise ValueError("--api-key must be at least 8 characters")


class ApiServer:
    """The API over one engine. ``service_of`` and ``lock``: see EngineLane."""

    def __init__(self, service_of: Callable[[], AnswerService | None],
                 lock: AbstractContextManager,
                 host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 api_key: str | None = None, max_waiting: int = DEFAULT_QUEUE,
                 max_tokens: int = 4096,
                 execute: Callable[[Callable[[], GenerationResult]], GenerationResult]
                 | None = None, parallel: int = 1) -> None:
        """``execute``: how a job reaches the engine's thread (see EngineLane); None for
        ``run`` in the thread that made the engine. ``parallel``: answers decoded
        together, as many as ``lanes_allowed`` lets; ``parallel_note`` says why fewer."""
        check_binding(host, port, api_key)
        self.parallel, self.parallel_note = 1, ""
        if parallel > 1:
            service = service_of()
            self.parallel, self.parallel_note = lanes_allowed(
                service.current() if service is not None else None, parallel)
        self.lane: EngineLane | ParallelEngineLane
        if self.parallel > 1:
            self.lane = ParallelEngineLane(service_of, max_waiting, self.parallel,
                                           execute=execute,  # type: ignore[arg-type]
                                           lock=lock if execute is not None else None)
        else:
            self.lane = EngineLane(service_of, lock, max_waiting,
                                   own_thread=execute is not None, execute=execute)
        state = ServerState(self.lane, service_of, Limits(max_tokens=max_tokens), api_key)
        # Bind and listen now, so a port in use is an error here, port 0 gets its number,
        # and a client that connects as soon as the address is shown waits in the backlog
        # for the HTTP thread instead of being refused (it was, once, in CI).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        config = uvicorn.Config(make_app(state), log_level="warning", access_log=False,
                                lifespan="off")
        try:
            self._socket.bind((host, port))
            self._socket.listen(config.backlog)
        except OSError as exc:
            self._socket.close()
            self.lane.close()
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.host, self.port = host, self._socket.getsockname()[1]
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        """Serve until Ctrl-C: HTTP on a thread, the engine's jobs here (the thread that
        made the engine)."""
        self.start()
        try:
            self.lane.run_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def start(self) -> None:
        """Serve HTTP on a thread; ``stop`` ends it."""
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="tandem-api-http", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.lane.close()
        self._socket.close()
