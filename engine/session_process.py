"""An engine whose target runs through workers, kept in a child process.

llama.cpp's RPC client aborts the process when a worker stops answering mid-decode
(``RPC_STATUS_ASSERT`` in ggml-rpc.cpp: no error code reaches the caller). So the
``Engine`` of a remote layout lives in a child process, and ``EngineProcess`` stands in for
it here with the same surface the front ends use: ``generate`` (text and steps streamed
back, stopping through a shared flag), ``target`` (tokenising, the template, the context),
the plan and notes. When the child dies, every call raises ``WorkerLostError`` with what
llama.cpp said last; the front end ends the answer with that message and
``engine.conversation.AnswerService.recover`` reopens the model here where it fits.

Everything crossing the pipe is pickled: results are plain dataclasses and numpy arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError, TandemError, WorkerError, WorkerLostError
from engine.runtime.context_fit import DEFAULT_POLICY

if TYPE_CHECKING:  # the child imports them; the parent only names them
    from engine.decoding.generation import GenerationConfig, GenerationResult
    from engine.decoding.logprobs import TokenLogprob
    from engine.decoding.stats import StepStats
    from engine.planning.calibration import CostProfile
    from engine.planning.kernels import KernelChoice
    from engine.planning.plan_log import PlanEvent
    from engine.planning.planner import Plan
    from engine.runtime.architecture import ArchitectureFacts
    from engine.runtime.chat_template import ChatTemplate
    from engine.runtime.context_fit import FittedPrompt
    from engine.runtime.hardware import HardwareProfile
    from engine.runtime.model_info import ModelInfo
    from engine.session import Engine, EngineConfig
    from engine.workers.handshake import WorkerInfo

POLL_S = 0.05  # how often a waiting call looks at should_stop and the child's health
SETTLE_S = 30.0  # how long an interrupted call may take to stop
_PROJECT_ROOT = str(Path(__file__).resolve().parents[1])  # where `-m engine...` imports from


# --- what the parent reads without a round trip ---------------------------------------------
@dataclass(frozen=True)
class EngineFacts:
    """The ``Engine``'s members ``EngineProcess`` gives without a round trip: each field
    is the member of that name, read in the child after the engine opens and after every
    call of the engine's own (a plan may change with the answers). A member the engine
    lacks is an AttributeError at once (``read_facts``), never a None."""

    notes: list[str]
    plan: Plan | None
    costs: CostProfile | None
    hardware: HardwareProfile
    model: ModelInfo
    kernels: KernelChoice | None
    n_threads: int
    max_draft: int
    calibrated_now: bool
    remeasure_wanted: bool
    plan_events: list[PlanEvent]
    drafter_name: str
    guarantee: str
    verifies_exactly: bool
    architecture: dict[str, object]
    kv_cache_text: str
    workers: tuple[WorkerInfo, ...]
    threads_text: str


@dataclass(frozen=True)
class TargetFacts:
    """The ``Target``'s fixed facts ``EngineProcess.target`` gives without a round trip
    (its methods go through the pipe): each field is the member of that name."""

    path: Path
    n_ctx: int
    n_threads: int
    n_vocab: int
    template: ChatTemplate
    arch: ArchitectureFacts
    n_gpu_layers: int
    f16_prefill_off: str | None


@dataclass(frozen=True)
class _Facts:
    engine: EngineFacts
    target: TargetFacts


def read_facts(facts: type[EngineFacts] | type[TargetFacts], owner: object, what: str
               ) -> dict[str, Any]:
    """Each field of ``facts`` read from ``owner`` (``what``, in the message): raises
    AttributeError naming the first member ``owner`` lacks."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(facts):
        try:
            values[f.name] = getattr(owner, f.name)
        except AttributeError as exc:
            raise AttributeError(f"{what} has no {f.name!r}, which {facts.__name__} "
                                 f"(engine.session_process) gives the parent: {exc}") from exc
    return values


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


def _snapshot(engine: Any) -> dict[str, dict[str, Any]]:
    """The engine's and its target's facts, as plain values (the dataclasses are built on
    the parent's side: this module runs as ``__main__`` here)."""
    return {"engine": read_facts(EngineFacts, engine, "the engine"),
            "target": read_facts(TargetFacts, engine.target, "the engine's target")}


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
    try:
        facts = _snapshot(engine)
    except AttributeError as exc:  # a fact the engine lacks: the parent raises it
        conn.send(("err", _pack_error(exc), traceback.format_exc()))
        engine.close()
        return
    conn.send(("ok", None, facts))
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
        # Only the engine's own methods change what the snapshot holds (a plan that
        # switched after an answer, costs measured again); reads and the target's calls
        # send none.
        facts = _snapshot(engine) if where == "engine" and args is not None else None
    except BaseException as exc:  # noqa: BLE001
        conn.send(("err", _pack_error(exc), traceback.format_exc()))
        return
    conn.send(("ok", result, facts))


# --- the parent --------------------------------------------------------------------------
def _unpack_error(packed: tuple[str, str, tuple, dict, str]) -> BaseException:
    module, qualname, args, state, text = packed
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        exc = cls.__new__(cls)
        exc.args = args
        exc.__dict__.update(state)
        return exc
    except Exception:  # noqa: BLE001 - a class this side cannot rebuild
        return TandemError(text)


class _TargetProxy:
    """The child's target: its fixed facts (``TargetFacts``) from the snapshot, its
    methods through the pipe; token bytes are cached (the GUI asks for every token of an
    answer)."""

    def __init__(self, process: EngineProcess) -> None:
        self._process = process
        self._bytes: dict[int, bytes] = {}

    @property
    def facts(self) -> TargetFacts:
        return self._process._known().target

    @property
    def path(self) -> Path:
        return self.facts.path

    @property
    def n_ctx(self) -> int:
        return self.facts.n_ctx

    @property
    def n_threads(self) -> int:
        return self.facts.n_threads

    @property
    def n_vocab(self) -> int:
        return self.facts.n_vocab

    @property
    def template(self) -> ChatTemplate:
        return self.facts.template

    @property
    def arch(self) -> ArchitectureFacts:
        return self.facts.arch

    @property
    def n_gpu_layers(self) -> int:
        return self.facts.n_gpu_layers

    @property
    def f16_prefill_off(self) -> str | None:
        return self.facts.f16_prefill_off

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._process._call("target", name, args, kwargs)[1]

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self._call("tokenize", text, special=special)

    def detokenize(self, tokens: list[int]) -> str:
        return self._call("detokenize", list(tokens))

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None, tools: list[dict] | None = None
                    ) -> list[int]:
        return self._call("chat_prompt", messages, add_generation_prompt, enable_thinking,
                          tools)

    def is_end_of_generation(self, token: int) -> bool:
        return self._call("is_end_of_generation", token)

    def reset(self, cold: bool = False) -> None:
        self._call("reset", cold)

    def settle(self) -> None:
        self._call("settle")

    def token_bytes(self, token: int) -> bytes:
        if token not in self._bytes:
            self._bytes[token] = self._call("token_bytes", token)
        return self._bytes[token]


class EngineProcess:
    """``Engine(config)`` in a child process (see the module docstring), with the
    surface the front ends use: the engine's facts from a snapshot the child sends after
    every call that may change them, its methods through the pipe. A context manager;
    ``close()`` is idempotent. Raises what ``Engine`` raises, and WorkerLostError once
    the child is gone."""

    def __init__(self, config: EngineConfig, progress: Callable[[str], None] | None = None
                 ) -> None:
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
        self._facts: _Facts | None = None
        self._lost: WorkerLostError | None = None
        self._stop_sent = False
        self._replied = True
        self._conn.send(config)
        self.target = _TargetProxy(self)
        try:
            self._wait({"progress": progress} if progress else {}, None)
        except BaseException:
            self.close()
            raise

    # the engine's facts (the snapshot) ----------------------------------------------
    def _known(self) -> _Facts:
        if self._facts is None:
            raise RuntimeError("the engine's facts: the child has not sent them yet")
        return self._facts

    @property
    def facts(self) -> EngineFacts:
        """The engine's facts as the child sent them after its last call that may have
        changed them."""
        return self._known().engine

    @property
    def notes(self) -> list[str]:
        return self.facts.notes

    @property
    def plan(self) -> Plan | None:
        return self.facts.plan

    @property
    def costs(self) -> CostProfile | None:
        return self.facts.costs

    @property
    def hardware(self) -> HardwareProfile:
        return self.facts.hardware

    @property
    def model(self) -> ModelInfo:
        return self.facts.model

    @property
    def kernels(self) -> KernelChoice | None:
        return self.facts.kernels

    @property
    def n_threads(self) -> int:
        return self.facts.n_threads

    @property
    def max_draft(self) -> int:
        return self.facts.max_draft

    @property
    def calibrated_now(self) -> bool:
        return self.facts.calibrated_now

    @property
    def remeasure_wanted(self) -> bool:
        return self.facts.remeasure_wanted

    @property
    def plan_events(self) -> list[PlanEvent]:
        return self.facts.plan_events

    @property
    def drafter_name(self) -> str:
        return self.facts.drafter_name

    @property
    def guarantee(self) -> str:
        return self.facts.guarantee

    @property
    def verifies_exactly(self) -> bool:
        return self.facts.verifies_exactly

    @property
    def architecture(self) -> dict[str, object]:
        return self.facts.architecture

    @property
    def kv_cache_text(self) -> str:
        return self.facts.kv_cache_text

    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        return self.facts.workers

    @property
    def threads_text(self) -> str:
        return self.facts.threads_text

    # the engine's methods (through the pipe) ----------------------------------------
    def _engine_call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._call("engine", name, args, kwargs)[1]

    def generate(self, prompt: list[int], config: GenerationConfig | None = None, *,
                 on_text: Callable[[str], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 plain: bool = False, remember: bool = True,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
                 ) -> GenerationResult:
        callbacks = {k: v for k, v in (("on_text", on_text), ("on_step", on_step),
                                       ("on_logprobs", on_logprobs)) if v}
        return self._call("engine", "generate", (list(prompt), config),
                          {"plain": plain, "remember": remember}, callbacks, should_stop)[1]

    def remeasure(self, progress: Callable[[str], None] | None = None) -> bool:
        return self._call("engine", "remeasure", (), {},
                          {"progress": progress} if progress else {})[1]

    def pin_drafting(self, slope: float = 0.35) -> None:
        self._engine_call("pin_drafting", slope)

    def check_grammar(self, gbnf: str) -> None:
        self._engine_call("check_grammar", gbnf)

    def fit_chat(self, messages: list[dict[str, Any]], max_tokens: int,
                 policy: str = DEFAULT_POLICY, enable_thinking: bool | None = None,
                 tools: list[dict] | None = None) -> FittedPrompt:
        return self._engine_call("fit_chat", messages, max_tokens, policy, enable_thinking,
                                 tools)

    def chat_prompt(self, messages: list[dict[str, Any]],
                    enable_thinking: bool | None = None, tools: list[dict] | None = None
                    ) -> list[int]:
        return self._engine_call("chat_prompt", messages, enable_thinking, tools)

    def plan_status(self) -> dict[str, object] | None:
        return self._engine_call("plan_status")

    def describe(self) -> str:
        return self._engine_call("describe")

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
                    self._facts = _Facts(EngineFacts(**message[2]["engine"]),
                                         TargetFacts(**message[2]["target"]))
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


def open_engine(config: EngineConfig, progress: Callable[[str], None] | None = None
                ) -> Engine | EngineProcess:
    """The engine ``config`` asks for: in this process, or in a child when its target
    uses workers."""
    if config.workers:
        return EngineProcess(config, progress)
    from engine.session import Engine
    return Engine(config, progress=progress)


def check_fits_here(config: EngineConfig) -> None:
    """Raise ModelLoadError when the model ``config`` asks for does not fit this machine's
    available memory (after a worker that held it is lost), by the one rule
    (engine.runtime.memory_fit) the wizard and the planner use."""
    import psutil

    from engine.hub.model_store import default_model_path
    from engine.planning.memory_plan import planned_memory
    from engine.runtime.kv_cache import KV_MODES
    from engine.runtime.memory_fit import RAM_HEADROOM, fits_ram
    from engine.runtime.model_info import read_model_info
    from engine.session import context_length

    info = read_model_info(config.model_path or default_model_path())
    type_k, type_v = KV_MODES[config.kv_cache]
    # What the engine will take here, by the plan's rule (its parts: the F16 context, the
    # attention scores), not a GPU's allowance.
    need = planned_memory(info, context_length(config, info), type_k, type_v,
                          flash_attn=config.flash_attn).total
    free = psutil.virtual_memory().available
    if not fits_ram(need, free):
        raise ModelLoadError(
            f"{info.path.name} needs {need / 2**30:.1f} GiB and this machine has "
            f"{free * RAM_HEADROOM / 2**30:.1f} GiB to give it: it cannot run here "
            "without the worker")


if __name__ == "__main__":  # the child: python -m engine.session_process FD
    _child_main(Connection(int(sys.argv[1])))


__all__ = ["EngineProcess", "WorkerError", "WorkerLostError", "check_fits_here",
           "open_engine"]
