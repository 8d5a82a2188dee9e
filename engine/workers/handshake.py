"""A worker asked, from Python, what llama.cpp would ask it first: its protocol version,
its devices and their memory, and how long a round trip takes.

llama.cpp's RPC client aborts the whole process when a connect or a handshake fails
(``GGML_ABORT`` in ggml-rpc.cpp), so Tandem asks first and refuses with a reason. The wire
format (ggml-rpc.cpp): a request is ``cmd (1 byte) | size (u64) | payload``, a reply
``size (u64) | payload``; HELLO must come first on a connection.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

from engine.errors import WorkerError
from engine.workers.endpoints import parse_endpoint

# The RPC protocol of the vendored llama.cpp (ggml/include/ggml-rpc.h). A worker must have
# this major version and no newer minor one (the client's own rule). tests/test_workers.py
# checks it against the library's own server.
PROTOCOL = (7, 0, 0)

CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14
CMD_DEVICE_COUNT = 15
CONN_CAPS_SIZE = 24  # transport capabilities; zeros ask for plain TCP
HELLO_REPLY_SIZE = 4 + CONN_CAPS_SIZE
TIMEOUT_S = 5.0
PING_ROUNDS = 5


@dataclass(frozen=True)
class WorkerDevice:
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class WorkerInfo:
    endpoint: str
    version: tuple[int, int, int]
    devices: tuple[WorkerDevice, ...]
    round_trip_s: float  # the median of a few tiny requests

    @property
    def free_bytes(self) -> int:
        return sum(d.free_bytes for d in self.devices)

    def describe(self) -> str:
        mib = self.free_bytes / 2**20
        return (f"{self.endpoint}: protocol {'.'.join(map(str, self.version))}, "
                f"{len(self.devices)} device(s), {mib:,.0f} MiB free, round trip "
                f"{self.round_trip_s * 1e3:.2f} ms")


def version_compatible(version: tuple[int, int, int]) -> bool:
    return version[0] == PROTOCOL[0] and version[1] <= PROTOCOL[1]


class _Wire:
    """One connection, speaking ggml-rpc's framing."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        host, port = parse_endpoint(endpoint)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise WorkerError(endpoint, f"cannot connect ({exc.strerror or exc}); is "
                              "`tandem worker` running there?") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(self, cmd: int, payload: bytes, reply_size: int) -> bytes:
        try:
            self.sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
            size = struct.unpack("<Q", self._recv(8))[0]
            if size != reply_size:
                raise WorkerError(self.endpoint, f"answered {size} bytes where {reply_size} "
                                  "were due: not a llama.cpp RPC server of this protocol")
            return self._recv(size)
        except TimeoutError as exc:
            raise WorkerError(self.endpoint, "connected but did not answer: it is busy "
                              "serving another client, or not a llama.cpp worker") from exc
        except OSError as exc:
            raise WorkerError(self.endpoint, f"the connection failed ({exc})") from exc

    def _recv(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise WorkerError(self.endpoint, "closed the connection: not a llama.cpp "
                                  "worker, or one that refused this client")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        self.sock.close()


def probe_worker(endpoint: str, timeout_s: float = TIMEOUT_S) -> WorkerInfo:
    """Connect, check the protocol version, read the devices' memory, time a round trip,
    disconnect (a worker serves one client at a time). Raises WorkerError with the reason."""
    wire = _Wire(endpoint, timeout_s)
    try:
        reply = wire.call(CMD_HELLO, bytes(CONN_CAPS_SIZE), HELLO_REPLY_SIZE)
        version = (reply[0], reply[1], reply[2])
        if not version_compatible(version):
            raise WorkerError(endpoint, "speaks RPC protocol {} and this Tandem {}: run the "
                              "same Tandem (the same llama.cpp) on both machines".format(
                                  ".".join(map(str, version)), ".".join(map(str, PROTOCOL))))
        times = []
        count = 0
        for _ in range(PING_ROUNDS):
            t0 = time.perf_counter()
            count = struct.unpack("<I", wire.call(CMD_DEVICE_COUNT, b"", 4))[0]
            times.append(time.perf_counter() - t0)
        devices = []
        for device in range(count):
            free, total = struct.unpack("<QQ", wire.call(CMD_GET_DEVICE_MEMORY,
                                                         struct.pack("<I", device), 16))
            devices.append(WorkerDevice(free, total))
    finally:
        wire.close()
    if not devices:
        raise WorkerError(endpoint, "serves no device")
    return WorkerInfo(endpoint, version, tuple(devices), sorted(times)[len(times) // 2])
