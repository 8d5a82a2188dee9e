"""A `tandem worker` of this checkout started on a free loopback port, for the workers
benchmark and the tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from engine.errors import WorkerError
from engine.workers.handshake import probe_worker

REPO = Path(__file__).resolve().parents[2]
START_WAIT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_worker(threads: int, *extra: str, capture: bool = False
                    ) -> Iterator[tuple[str, subprocess.Popen]]:
    """(its HOST:PORT, its process) once it answers a handshake, until the block ends.
    ``extra``: more flags; ``capture``: its output piped (text) for the caller to read.
    Raises WorkerError (with what it said, when captured) if it exits before answering."""
    port = free_port()
    output = subprocess.PIPE if capture else subprocess.DEVNULL
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "worker", "--port", str(port),
                                "--threads", str(threads), *extra], cwd=REPO, text=True,
                               stdout=output,
                               stderr=subprocess.STDOUT if capture else subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"
    # Its busy cores are the target's work, not another program's (engine.planning.
    # machine_load): engines started meanwhile, in child processes too, inherit this.
    os.environ["TANDEM_HELPER_PIDS"] = str(process.pid)
    try:
        deadline = time.monotonic() + START_WAIT_S
        while True:
            with contextlib.suppress(WorkerError):
                probe_worker(endpoint)
                break
            if process.poll() is not None or time.monotonic() > deadline:
                said = process.stdout.read() if capture and process.stdout else ""
                raise WorkerError(endpoint, f"the loopback worker did not start {said}".strip())
            time.sleep(0.05)
        yield endpoint, process
    finally:
        os.environ.pop("TANDEM_HELPER_PIDS", None)
        process.kill()
        process.wait(10)
