"""A TCP relay that adds a fixed round trip, to show what a real network does to a worker
on loopback where the kernel has no ``tc netem`` (this sandbox's has none).

Each direction delays every chunk by half the round trip, in order; bandwidth is not
limited (on a LAN, latency is what a decode's many small messages feel). Bench use only.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time


class LatencyProxy:
    """Listens on 127.0.0.1 (``endpoint``) and relays to ``upstream`` (HOST:PORT)."""

    def __init__(self, upstream: str, round_trip_s: float) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._delay = round_trip_s / 2
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="latency-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sockets.append(s)
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 16)
                except OSError:
                    data = b""
                chunks.put((time.perf_counter() + self._delay, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = chunks.get()
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self._server.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
