"""``tandem worker``: this machine's devices served to other Tandem instances through
llama.cpp's RPC server, with the bind policy of engine.workers.endpoints.

The server computes with the same library as the engine, so the same exact-kernel
settings hold there: the prompt kernels' switch (llamafile's sgemm) is never turned on
in this process, and importing engine.runtime.native sets ``GGML_CPU_TILED_MM=0`` before
llama.cpp loads. Weights sent to
a worker are never repacked (the RPC server allocates plain buffers).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

from engine.errors import InvalidSettingError
from engine.runtime.hardware import default_threads
from engine.runtime.native_rpc import Device, local_devices, require_rpc, serve_devices
from engine.workers.endpoints import DEFAULT_PORT, EXPOSED_WARNING, check_bind, is_loopback


def pick_devices(spec: str) -> list[Device]:
    """``cpu``, ``cuda:0`` / ``vulkan:1`` (llama.cpp's CUDA0, Vulkan1...), or a device's
    own name; comma-separated for several. Raises InvalidSettingError naming what exists."""
    found = local_devices()
    chosen = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name = re.sub(r"^([a-z]+):(\d+)$", lambda m: m.group(1) + m.group(2), part.lower())
        matches = [d for d in found if d.name.lower() == name
                   or (name == "cpu" and d.kind == "cpu")]
        if not matches:
            names = ", ".join(d.name for d in found)
            raise InvalidSettingError("device", f"is not one of this machine's ({names})",
                                      part)
        chosen.append(matches[0])
    if not chosen:
        raise InvalidSettingError("device", "names no device", spec)
    return chosen


class Worker:
    """A running RPC server. llama.cpp's server loop never returns, so it runs in a
    daemon thread; the process ends it by exiting."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 device: str = "cpu", n_threads: int | None = None,
                 allow_network: bool = False, cache_dir: Path | None = None,
                 say: Callable[[str], None] = print) -> None:
        """Raises InvalidSettingError (a bind beyond loopback not allowed, an unknown
        device), ModelLoadError (a build without RPC)."""
        check_bind(host, allow_network)
        require_rpc()
        self.endpoint = f"{host}:{port}"
        self.devices = pick_devices(device)
        self.n_threads = n_threads or default_threads()
        if not is_loopback(host):
            say(EXPOSED_WARNING.format(host=host, port=port))
        self._thread = threading.Thread(
            target=serve_devices, name="tandem-worker", daemon=True,
            args=(self.endpoint, self.devices, self.n_threads, cache_dir))

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the server still runs after ``timeout_s`` (it stops on its own only
        when it cannot listen)."""
        self._thread.join(timeout_s)
        return self._thread.is_alive()
