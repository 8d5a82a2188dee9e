"""An engine whose target runs through workers, kept in a child process.

llama.cpp's RPC client aborts the process when a worker stops answering mid-decode
(``RPC_STATUS_ASSERT`` in ggml-rpc.cpp: no error code reaches the caller). So the
``Engine`` of a remote layout lives in a child process, and ``EngineProcess`` stands in for
it here with the same surface the front ends use: ``generate`` (text and steps streamed
back, stopping through a shared flag), ``target`` (tokenising, the template, the context),
the plan and notes. When the child dies, every call raises ``WorkerLostError`` with what
llama.cpp said last; the front end ends the answer with that message and reopens the
engine locally (``reopen_locally``) where the model fits.

Everything crossing the pipe is pickled: results are plain dataclasses and numpy arrays.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, TandemError, WorkerError, WorkerLostError

# Engine attributes read here without a round trip, refreshed after every call (a plan
# may change with the answers).
_SNAPSHOT = ("notes", "plan", "costs", "hardware", "model", "kernels", "n_threads",
             "max_draft", "calibrated_now", "remeasure_wanted", "config", "plan_events",
             "drafter_name", "guarantee", "architecture", "kv_cache_text", "workers")
_TARGET_SNAPSHOT = ("path", "n_ctx", "n_threads", "n_vocab", "template", "arch",
                    "n_gpu_layers", "f16_prefill_off")
POLL_S = 0.05  # how often a waiting call looks at should_stop and the child's health
SETTLE_S = 30.0  # how long an interrupted call may take to stop
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])  # where `-m engine...` imports from


# --- the child ---------------------------------------------------------------------------
def _pack_error(exc: BaseException) -> tuple[str, str, tuple, dict, str]:
    state = {k: v for k, v in vars(exc).items() if _picklable(v)}
    return (type(exc).__module__, type(exc).__qualname__, exc.args, state, str(exc))


def _picklable(value: object) -> bool:
    import pickle
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _snapshot(engine: Any) -> dict[str, Any]:
    values = {name: getattr(engine, name, None) for name in _SNAPSHOT}
    values["target"] = {name: getattr(engine.target, name, None) for name in _TARGET_SNAPSHOT}
    return values


def _child_main(conn: Connection) -> None:
    """Build the engine the first message asks for, then serve calls until told to close
    or the parent goes."""
    from engine.session import Engine

    # Ctrl-C in a terminal reaches the whole process group: the parent stops the call
    # (a "stop" message), this process must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = conn.recv()
    stop = _StopFlag(conn)
    try:
        engine = Engine(config, progress=lambda what: conn.send(("cb", "progress", (what,))))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back as it was
        conn.send(("err", _pack_error(exc), traceback.format_exc()))
        return
    conn.send(("ok", None, _snapshot(engine)))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the parent is gone
                return
            if message[0] == "close":
                return
            if message[0] == "call":
                stop.clear()
                _serve_call(conn, stop, engine, *message[1:])
    finally:
        engine.close()


class _StopFlag:
    """The parent's stop request: a "stop" message waiting on the pipe, looked at between
    steps (the parent sends nothing else while a call runs)."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._set = conn, False

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        while not self._set and self._conn.poll(0):
            self._set = self._conn.recv()[0] == "stop"
        return self._set


def _forwarder(conn: Connection, name: str) -> Callable[..., None]:
    """A callback of the child that sends its arguments to the parent's own."""
    def forward(*args: Any) -> None:
        conn.send(("cb", name, args))
    return forward


def _serve_call(conn: Connection, stop: _StopFlag, engine: Any, where: str, name: str,
                args: tuple, kwargs: dict, callbacks: tuple[str, ...], stoppable: bool
                ) -> None:
    owner = engine.target if where == "target" else engine
    try:
        attr = getattr(owner, name)
        if args is None:  # an attribute read
            result = ("method", None) if callable(attr) else ("value", attr)
        else:
            for cb in callbacks:
                kwargs[cb] = _forwarder(conn, cb)
            if stoppable:
                kwargs["should_stop"] = stop.is_set
            result = ("value", attr(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001
        conn.send(("err", _pack_error(exc), traceback.format_exc()))
        return
    # Only the engine's own methods change what the snapshot holds (a plan that switched
    # after an answer, costs measured again); reads and the target's calls send none.
    changed = where == "engine" and args is not None
    conn.send(("ok", result, _snapshot(engine) if changed else None))


# --- the parent --------------------------------------------------------------------------
def _unpack_error(packed: tuple[str, str, tuple, dict, str]) -> BaseException:
    module, qualname, args, state, text = packed
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        exc = cls.__new__(cls)
        exc.args = args
        exc.__dict__.update(state)
        return exc
    except Exception:  # noqa: BLE001 - a class this side cannot rebuild
        return TandemError(text)


class _Remote:
    """Attribute reads and method calls on one object of the child's engine."""

    def __init__(self, process: EngineProcess, where: str) -> None:
        self._process, self._where = process, where
        self._methods: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._methods:
            kind, value = self._process._call(self._where, name, None, {})
            if kind == "value":
                return value
            self._methods.add(name)

        def method(*args: Any, **kwargs: Any) -> Any:
            return self._process._call(self._where, name, args, kwargs)[1]
        return method


class _TargetProxy(_Remote):
    """The child's target: its fixed facts read from the snapshot, the rest remote;
    token bytes are cached (the GUI asks for every token of an answer)."""

    def __init__(self, process: EngineProcess) -> None:
        super().__init__(process, "target")
        self._bytes: dict[int, bytes] = {}

    def __getattr__(self, name: str) -> Any:
        facts = self._process._state.get("target", {})
        if name in facts:
            return facts[name]
        return super().__getattr__(name)

    def token_bytes(self, token: int) -> bytes:
        if token not in self._bytes:
            self._bytes[token] = self._process._call("target", "token_bytes", (token,), {})[1]
        return self._bytes[token]


class EngineProcess:
    """``Engine(config)`` in a child process (see the module docstring). A context manager;
    ``close()`` is idempotent. Raises what ``Engine`` raises, and WorkerLostError once the
    child is gone."""

    def __init__(self, config: Any, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        # Its own interpreter (not multiprocessing's spawn, which re-runs the caller's main
        # module): no llama.cpp state inherited, and stderr (llama.cpp's last words) kept.
        ours, theirs = socket.socketpair()
        self._log = tempfile.NamedTemporaryFile(prefix="tandem-engine-", suffix=".log")  # noqa: SIM115 - lives with the child
        self._process = subprocess.Popen(
            [sys.executable, "-m", "engine.session_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self._log, cwd=_PROJECT_ROOT)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._state: dict[str, Any] = {}
        self._lost: WorkerLostError | None = None
        self._stop_sent = False
        self._replied = True
        self._conn.send(config)
        self.target = _TargetProxy(self)
        self._engine = _Remote(self, "engine")
        try:
            self._wait({"progress": progress} if progress else {}, None)
        except BaseException:
            self.close()
            raise

    # the engine's surface ------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _SNAPSHOT:
            return self._state.get(name)
        return getattr(self._engine, name)

    def generate(self, prompt: list[int], config: Any = None, *,
                 on_text: Callable[[str], None] | None = None,
                 on_step: Callable[[Any], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 plain: bool = False, remember: bool = True) -> Any:
        callbacks = {k: v for k, v in (("on_text", on_text), ("on_step", on_step)) if v}
        return self._call("engine", "generate", (list(prompt), config),
                          {"plain": plain, "remember": remember}, callbacks, should_stop)[1]

    def remeasure(self, progress: Callable[[str], None] | None = None) -> bool:
        return self._call("engine", "remeasure", (), {},
                          {"progress": progress} if progress else {})[1]

    @property
    def alive(self) -> bool:
        return self._lost is None and self._process.poll() is None

    def close(self) -> None:
        if self._process.poll() is None and self._lost is None:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(("close",))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(10)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait(5)
        self._conn.close()
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the pipe ------------------------------------------------------------------------
    def _call(self, where: str, name: str, args: tuple | None, kwargs: dict,
              callbacks: dict[str, Callable] | None = None,
              should_stop: Callable[[], bool] | None = None) -> tuple[str, Any]:
        if self._lost is not None:
            raise self._lost
        callbacks = callbacks or {}
        self._stop_sent = False
        try:
            self._conn.send(("call", where, name, args, kwargs, tuple(callbacks),
                             should_stop is not None))
        except (OSError, ValueError):
            raise self._lose() from None
        self._replied = False
        try:
            return self._wait(callbacks, should_stop)
        except BaseException:
            if not self._replied and self._lost is None:
                # Interrupted here (Ctrl-C, a callback that raised) while the child is
                # still in the call: stop it and read its reply away, so the next call
                # gets its own.
                self._settle_after_interrupt()
            raise

    def _settle_after_interrupt(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("stop",))
        deadline = time.monotonic() + SETTLE_S
        try:
            while time.monotonic() < deadline:
                if self._conn.poll(POLL_S) and self._conn.recv()[0] in ("ok", "err"):
                    return
        except (EOFError, OSError):
            pass
        self._process.kill()  # it did not finish: it cannot be trusted with another call
        self._lose()

    def _wait(self, callbacks: dict[str, Callable], should_stop: Callable[[], bool] | None
              ) -> Any:
        while True:
            try:
                ready = self._conn.poll(POLL_S)
                message = self._conn.recv() if ready else None
            except (EOFError, OSError):
                raise self._lose() from None
            if should_stop is not None and not self._stop_sent and should_stop():
                with contextlib.suppress(OSError, ValueError):
                    self._conn.send(("stop",))
                self._stop_sent = True
            if message is None:
                if self._process.poll() is not None and not self._conn.poll(0):
                    raise self._lose()
                continue
            kind = message[0]
            self._replied = kind != "cb"
            if kind == "cb":
                callback = callbacks.get(message[1])
                if callback is not None:
                    callback(*message[2])
            elif kind == "ok":
                if message[2] is not None:
                    self._state = message[2]
                return message[1]
            else:
                raise _unpack_error(message[1])

    def _lose(self) -> WorkerLostError:
        """The child is gone: what llama.cpp said last, and which worker stopped."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(5)
        try:
            said = Path(self._log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            said = []
        last = next((ln for ln in reversed(said) if "rpc" in ln.lower() or "abort" in
                     ln.lower() or "error" in ln.lower()), said[-1] if said else "")
        workers = tuple(getattr(self.config, "workers", ()))
        endpoint = ", ".join(workers) or "(none)"
        why = "stopped answering while the target ran there; the engine that used it ended"
        if last:  # without the build's source path
            last = re.sub(r"^\S*/(?=[^/\s]+:\d+: )", "", last.strip())
            why += f" (llama.cpp: {last[:200]})"
        self._lost = WorkerLostError(endpoint, why)
        return self._lost


def open_engine(config: Any, progress: Callable[[str], None] | None = None) -> Any:
    """The engine ``config`` asks for: in this process, or in a child when its target
    uses workers."""
    if getattr(config, "workers", ()):
        return EngineProcess(config, progress)
    from engine.session import Engine
    return Engine(config, progress=progress)


def check_fits_here(model_path: Path | None) -> None:
    """Raise ModelLoadError when the model's weights do not fit this machine's free memory
    (after a worker that held them is lost)."""
    import psutil

    from engine.hub.model_store import default_model_path
    from engine.runtime.model_info import read_model_info

    path = model_path or default_model_path()
    need = read_model_info(path).size_bytes
    free = psutil.virtual_memory().available
    if need > free:
        raise ModelLoadError(
            f"{Path(path).name} needs {need / 2**30:.1f} GiB and this machine has "
            f"{free / 2**30:.1f} GiB free: it cannot run here without the worker")


def reopen_locally(config: Any, progress: Callable[[str], None] | None = None
                   ) -> tuple[Any, str]:
    """After a worker is lost: the same engine on this machine, and a note saying so.
    Raises ModelLoadError where the model does not fit this machine's memory."""
    check_fits_here(config.model_path)
    engine = open_engine(replace(config, workers=()), progress)
    return engine, "the worker was lost: the model now runs on this machine"


if __name__ == "__main__":  # the child: python -m engine.session_process FD
    _child_main(Connection(int(sys.argv[1])))


__all__ = ["EngineProcess", "WorkerError", "WorkerLostError", "check_fits_here",
           "open_engine", "reopen_locally"]
