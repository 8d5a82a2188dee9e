"""The engine's one serial lane: a QObject that lives in a QThread and owns the model.

Widgets never call the engine. They send requests by signal (queued into this thread)
and receive text, step statistics, results and failures by signal; failures cross as
``EngineFailure`` values. Stopping is the one direct call: ``request_stop`` sets a flag
the generation loop polls every step, since a queued signal would only arrive after the
generation it means to stop.
"""

from __future__ import annotations

import codecs
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from PySide6.QtCore import QObject, Signal, Slot

from app.gui.context_room import largest_context
from app.tools.model_support import tool_support_note
from app.tools.turns import for_model
from engine.conversation import AnswerService, Question, failure_of
from engine.decoding.budget import MAX_DRAFT
from engine.decoding.generation import GenerationConfig, GenerationResult
from engine.decoding.sampling import SamplingParams
from engine.decoding.stats import GenerationStats, StepStats
from engine.drafters import OFFERED_DRAFTERS
from engine.drafters.kinds import DrafterKind, Need
from engine.errors import TandemError, WorkerLostError
from engine.hub.fit import MachineMemory
from engine.hub.model_store import data_dir
from engine.hub.suggestions import memory_bandwidth, suggestions
from engine.planning.measure_progress import Measuring
from engine.planning.memory_plan import engine_memory
from engine.planning.planner import Overrides
from engine.runtime.context_fit import DEFAULT_POLICY
from engine.runtime.hardware import HardwareProfile, machine_line
from engine.runtime.target import Target
from engine.session import Engine, EngineConfig, loaded_memory
from engine.session_process import EngineProcess
from engine.tool_calls import Tool, ToolCall
from engine.tool_syntax import GENERIC, tool_syntax_of

log = logging.getLogger(__name__)
T = TypeVar("T")

DRAFTER_CHOICES = OFFERED_DRAFTERS  # what the window offers: engine.drafters has the one list


@dataclass(frozen=True)
class EngineChoice:
    """What to load. ``model_path`` None: the bundled default (prepared on first start);
    ``head_dir`` None: the head shipped for the bundled model; ``draft_model``: the GGUF
    the "draft" drafter runs (with "auto", one the planner may choose)."""

    model_path: Path | None = None
    drafter: str = DrafterKind.AUTO
    head_dir: Path | None = None
    max_draft: int = MAX_DRAFT
    n_ctx: int | None = None  # None: the engine's default for the model
    n_threads: int | None = None
    kv_cache: str = "exact"  # or "fast" (engine.runtime.kv_cache.KV_TRADE_OFF)
    draft_model: Path | None = None
    workers: tuple[str, ...] = ()  # HOST:PORT of `tandem worker`s for the target's layers


@dataclass(frozen=True)
class EngineReady:
    """The engine as loaded. ``note`` explains a fallback (empty when none happened)."""

    model_path: str
    drafter: str  # effective: "head", "draft", "memory", "lookup" or "none"
    requested: str  # what the user chose
    note: str
    n_ctx: int
    n_threads: int
    max_draft: int
    gpu: str | None  # the CUDA device name, None when torch sees no GPU
    # The planner's decision (engine.planning.planner.Plan.to_json), for auto.
    plan: dict | None = None
    kv_cache: str = ""  # the KV cache setting and its trade-off, in words
    guarantee: str = ""  # what speculation promises on this model (Engine.guarantee)
    completion: bool = False  # a base model: it continues the text it is given
    thinking_switch: bool = False  # the chat template can turn thinking off
    # When and how the plan's costs were measured and its last change (Engine.plan_status)
    plan_status: dict | None = None
    threads: str = ""  # how many threads the last answer decoded with, and why
    machine: str = ""  # this computer in one line (cores, memory, GPU)
    # Models that fit this machine, for a first start: (description, Hub repository)
    suggested: tuple[tuple[str, str], ...] = ()
    # The largest context a reload could ask for here, for attached documents: within the
    # model's trained length and the memory rule (app.gui.context_room); n_ctx when none.
    max_ctx: int = 0
    # What the model, its context and drafters take of memory, by the plan's rule.
    memory: str = ""
    # How the model is offered tools, and how well it uses them (app.tools.model_support)
    tools: str = ""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: int
    # The API's messages (engine.tool_syntax.Message), system prompt first: role and
    # content; an answer's tool_calls and the tool messages after it (app.tools.turns)
    messages: tuple[dict, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 512
    context_policy: str = DEFAULT_POLICY  # engine.runtime.context_fit
    thinking: bool = True  # for templates with a thinking switch (enable_thinking)
    grammar: str | None = None  # GBNF every token obeys (the chat's "Answer as JSON")
    # Text the answer should repeat (an attached file being edited): drafted from
    prediction: str = ""
    # Functions the answer may call (the chat's tool servers'), in the model's syntax
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # or "required": the answer is a call (held by a grammar)


@dataclass(frozen=True)
class StepEvent:
    """One verification with wall-clock times (``time.perf_counter`` of this process)."""

    request_id: int
    t_draft_start: float
    t_verify_start: float
    t_end: float
    step: StepStats


@dataclass(frozen=True)
class GenerationOutcome:
    request_id: int
    text: str
    finish_reason: str  # engine's reasons: "eos", "stop", "length", "context", "cancelled"
    stats: GenerationStats
    t_start: float  # perf_counter when the request started
    token_texts: tuple[str, ...]  # the answer split per token (UTF-8 joined correctly)
    token_kinds: tuple[str, ...]  # per token: "draft" (accepted) or "target"
    n_dropped: int = 0  # oldest messages left out to fit the context
    # Where tools were offered and the answer calls them: the calls, and the text the
    # model wrote before them (None: none)
    calls: tuple[ToolCall, ...] = ()
    call_content: str | None = None


@dataclass(frozen=True)
class Comparison:
    """The same prompt with the chosen drafter and with plain decoding."""

    request_id: int
    drafter: str
    stats_dft: GenerationStats
    stats_plain: GenerationStats
    identical: bool  # same tokens (expected when greedy: decoding is lossless)


@dataclass(frozen=True)
class EngineFailure:
    request_id: int  # -1 for a failed load
    kind: str  # "load", "context", "sampling", "engine", "internal"
    message: str


@dataclass
class _Call:
    fn: Callable[[], object]
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class EngineWorker(QObject):
    """Owns the engine (through its ``AnswerService``). Create in the GUI thread,
    ``moveToThread`` a QThread, then drive by signals; call ``request_stop`` from any
    thread."""

    status = Signal(str)  # progress text (model preparation, loading)
    measuring = Signal(object)  # Measuring: how far measuring this machine is, from 0 to 1
    ready = Signal(object)  # EngineReady
    text = Signal(int, str)  # request id, text delta
    step = Signal(object)  # StepEvent
    finished = Signal(object)  # GenerationOutcome
    compared = Signal(object)  # Comparison
    failed = Signal(object)  # EngineFailure
    stopped = Signal()  # shut down; the thread may quit
    plan_changed = Signal(object)  # EngineReady: the plan or what is known of it moved
    _call = Signal(object)  # a _Call for call_in_worker, run in the worker's thread

    def __init__(self) -> None:
        super().__init__()
        self._service: AnswerService | None = None
        self._suggestions: tuple[tuple[str, str], ...] | None = None
        self._tool_model: str | None = None  # a suggestion that calls tools
        self._requested: str = DrafterKind.AUTO  # the drafter the user chose for the loaded engine
        self._loaded: EngineChoice | None = None  # what the open engine was opened with
        # Held while the engine loads, generates or closes: the local API server
        # (app.server) runs its requests under it too, so they take turns with the chat.
        self.engine_lock = threading.RLock()
        # Called on this thread before a loaded model closes (another is chosen, the
        # window closes): the API's lanes free their context of it.
        self.before_close: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._stop_all = False
        self._call.connect(self._run_call)

    # --- called from any thread ------------------------------------------------------
    def request_stop(self, request_id: int | None = None) -> None:
        """Stop ``request_id`` (all work when None) at its next step."""
        with self._lock:
            if request_id is None:
                self._stop_all = True
            else:
                self._cancelled.add(request_id)

    def call_in_worker(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the worker's thread, after what is queued there, and return its
        result (or raise its error). For other threads (the local API server): llama.cpp
        runs at full speed only from the thread that made the engine."""
        call = _Call(fn)
        self._call.emit(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    @Slot(object)
    def _run_call(self, call: _Call) -> None:
        try:
            call.result = call.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            call.error = exc
        finally:
            call.done.set()

    def current_service(self) -> AnswerService | None:
        """The loaded engine's answer path (use it under ``engine_lock``), None while no
        engine is loaded."""
        return self._service

    def current_engine(self) -> Engine | EngineProcess | None:
        """The loaded engine (use it under ``engine_lock``), None while none is."""
        return self._service.engine if self._service is not None else None

    def _should_stop(self, request_id: int) -> bool:
        with self._lock:
            return self._stop_all or request_id in self._cancelled

    # --- slots, run in the worker thread ---------------------------------------------
    @Slot(object)
    def load(self, choice: EngineChoice) -> None:
        """Open the model and drafter (closing what was open); emits ready or failed."""
        with self.engine_lock:
            self._load(choice)

    def _load(self, choice: EngineChoice) -> None:
        """Open ``choice``; when that fails and an engine was open, the previous one comes
        back (ready, its note saying why the new one could not load): a reload that
        fails (a context raised for documents that does not fit after all, a model that
        went missing) never leaves the chat without an engine."""
        previous = self._loaded if self._service is not None else None
        why = self._try_open(choice)
        if why is None:
            return
        if previous is not None and previous != choice and \
                self._try_open(previous, because=why.message) is None:
            return
        self.failed.emit(why)

    def _try_open(self, choice: EngineChoice, because: str = "") -> EngineFailure | None:
        """Open ``choice`` and emit ready (its note led by ``because``, why the previous
        engine is back); the failure, with nothing open, when it cannot."""
        try:
            self._close_engine()
            self._open(choice)
            info = self._ready_info()
            if because:
                back = (f"Could not load the new setting ({because.rstrip('.')}): the "
                        "previous engine is back.")
                info = replace(info, note=f"{back} {info.note}".strip())
            self.ready.emit(info)
            return None
        except (TandemError, OSError, ValueError, MemoryError) as exc:
            self._close_engine()
            return EngineFailure(-1, "load", str(exc) or type(exc).__name__)
        except Exception as exc:  # a bug must reach the UI as data, not kill the thread
            log.exception("loading failed")
            self._close_engine()
            return EngineFailure(-1, "internal", f"{type(exc).__name__}: {exc}")

    def _open(self, choice: EngineChoice) -> None:
        if choice.drafter not in DRAFTER_CHOICES:
            raise ValueError(f"unknown drafter {choice.drafter!r}")
        kind = DrafterKind(choice.drafter)
        name = Path(choice.model_path).name if choice.model_path else "the bundled model"
        self.status.emit(f"Loading {name}…")
        if kind is DrafterKind.AUTO:
            # The planner measures this machine once (cached) and picks layout,
            # drafter and budget; the governor stops drafting that does not pay.
            self.status.emit("Measuring this machine (first start with this model only)…")
        overrides = Overrides(max_draft=choice.max_draft)
        # The draft model goes to a drafter that runs one, or to the planner's choice.
        wants_draft = kind is DrafterKind.AUTO or Need.DRAFT_GGUF in kind.needs
        draft = choice.draft_model if wants_draft else None
        if choice.workers:
            self.status.emit(f"Connecting to {', '.join(choice.workers)}…")
        self._service = AnswerService.open(EngineConfig(
            model_path=choice.model_path, drafter=choice.drafter, head_dir=choice.head_dir,
            overrides=overrides, n_ctx=choice.n_ctx, n_threads=choice.n_threads,
            kv_cache=choice.kv_cache, draft_model=draft, workers=choice.workers),
            progress=self._progress, auto_recover=False)
        self._requested = choice.drafter
        self._loaded = choice

    def _progress(self, what: str) -> None:
        if isinstance(what, Measuring):  # the first start's measurement: a progress bar
            self.measuring.emit(what)
        self.status.emit(what[:1].upper() + what[1:] + "…")

    @Slot(object)
    def generate(self, request: GenerationRequest) -> None:
        """Answer ``request``: emits text deltas and steps, then finished or failed (and
        plan_changed when the planner checked its plan against the answer)."""
        try:
            outcome = self._run(request, plain=False, stream=True)
        except WorkerLostError as exc:
            self.failed.emit(_failure(request.request_id, exc))
            self._reopen_locally()
            return
        except Exception as exc:
            self.failed.emit(_failure(request.request_id, exc))
            return
        finally:
            self._forget(request.request_id)
        self.finished.emit(outcome)
        self._plan_moved()

    def _reopen_locally(self) -> None:
        """After a lost worker: the same model and drafter on this machine where it fits
        (ready, with a note), else failed with why; the conversation stays as it was."""
        service = self._service
        if service is None:
            return
        with self.engine_lock:
            self.status.emit("The worker was lost: opening the model on this machine…")
            try:
                service.recover(self._progress)
            except Exception as exc:  # noqa: BLE001 - a failed load reaches the UI as data
                self.failed.emit(EngineFailure(-1, "load", str(exc)))
                return
            if service.engine is None:
                self.failed.emit(EngineFailure(-1, "load", service.why_not_here))
                return
            self.ready.emit(self._ready_info())

    @Slot()
    def remeasure(self) -> None:
        """Measure this machine's costs again when the engine wants it (provisional
        costs, or a plan the answers changed); the GUI asks when the app is idle."""
        with self.engine_lock:
            engine = self.current_engine()
            if engine is None or not engine.remeasure_wanted:
                return
            self.status.emit("Measuring this machine again while the app is idle…")
            try:
                engine.remeasure()
            except (TandemError, OSError) as exc:
                log.warning("measuring again failed: %s", exc)
            self.status.emit("Ready.")
        self._plan_moved()

    @Slot(object)
    def compare(self, request: GenerationRequest) -> None:
        """Run ``request`` with the drafter, then plain; emits compared or failed."""
        try:
            with_dft = self._run(request, plain=False, stream=False)
            plain = self._run(request, plain=True, stream=False)
        except Exception as exc:
            self.failed.emit(_failure(request.request_id, exc))
            return
        finally:
            self._forget(request.request_id)
        engine = self.current_engine()
        drafter = engine.drafter_name if engine is not None else DrafterKind.NONE
        self.compared.emit(Comparison(request.request_id, drafter,
                                      with_dft.stats, plain.stats,
                                      with_dft.text == plain.text))

    @Slot()
    def shutdown(self) -> None:
        """Close the model; emits stopped. Queue it after ``request_stop()``."""
        self._close_engine()
        self.stopped.emit()

    # --- internals -------------------------------------------------------------------
    def _ready_info(self) -> EngineReady:
        service = self._service
        engine = self.current_engine()
        assert service is not None and engine is not None
        target = engine.target
        gpu = engine.hardware.best_gpu
        lost = ([service.lost_note[:1].upper() + service.lost_note[1:] + " until it is "
                 "loaded again."] if service.lost_note else [])
        note = " ".join(lost + [n[:1].upper() + n[1:] + "." for n in engine.notes])
        return EngineReady(str(target.path), engine.drafter_name, self._requested, note,
                           target.n_ctx, target.n_threads, engine.max_draft,
                           gpu.name if gpu else None,
                           engine.plan.to_json() if engine.plan else None,
                           engine.kv_cache_text, engine.guarantee, target.template.completion,
                           plan_status=engine.plan_status(),
                           thinking_switch=target.template.thinking_switch,
                           threads=engine.threads_text, machine=machine_line(engine.hardware),
                           suggested=self._suggested(engine.hardware),
                           max_ctx=_max_ctx(engine),
                           memory=_memory_text(engine),
                           tools=self._tool_note(target))

    def _tool_note(self, target: Target) -> str:
        """How the model calls tools; for a small one, a model here that calls them."""
        try:
            size = Path(target.path).stat().st_size
        except OSError:
            size = 0
        return tool_support_note(tool_syntax_of(target.template.source).name, size,
                                 Path(target.path).name, self._tool_model)

    def _suggested(self, hardware: HardwareProfile) -> tuple[tuple[str, str], ...]:
        """Models that fit this machine, measured once per worker (a 0.1 s copy)."""
        if self._suggestions is None:
            memory = MachineMemory(hardware.ram_total_bytes, hardware.ram_available_bytes,
                                   hardware.best_gpu.free_bytes if hardware.best_gpu
                                   else None)
            try:
                bandwidth = memory_bandwidth(data_dir() / "cache")
            except OSError:  # a read-only disk: measured each time
                bandwidth = memory_bandwidth()
            found = suggestions(memory, bandwidth)
            self._suggestions = tuple((s.describe(), s.model.repo) for s in found)
            self._tool_model = next((f"{s.model.name} ({s.model.repo}, about "
                                     f"{s.tok_per_s:.0f} tokens/s here)"
                                     for s in found if s.model.tools), None)
        return self._suggestions

    def _plan_moved(self) -> None:
        engine = self.current_engine()
        if engine is not None and engine.plan is not None:
            self.plan_changed.emit(self._ready_info())

    def _run(self, request: GenerationRequest, plain: bool, stream: bool
             ) -> GenerationOutcome:
        service = self._service
        if service is None:
            raise TandemError("no model is loaded")
        rid = request.request_id
        t_start = time.perf_counter()
        generation = GenerationConfig(max_tokens=request.max_tokens,
                                      sampling=request.sampling, grammar=request.grammar,
                                      prediction=request.prediction)
        required = bool(request.tools) and request.tool_choice == "required"

        def on_step(step: StepStats) -> None:
            t_end = time.perf_counter() - step.reported_after_s
            t_verify = t_end - step.t_verify_s
            self.step.emit(StepEvent(rid, t_verify - step.t_draft_s, t_verify, t_end, step))

        with self.engine_lock:
            engine = service.current()
            syntax = tool_syntax_of(engine.target.template.source) \
                if engine is not None else GENERIC
            turn = for_model(list(request.messages), list(request.tools), syntax, required)
            if turn.grammar is not None:
                generation = replace(generation, grammar=turn.grammar)
            question = Question.chat(turn.messages, generation, request.context_policy,
                                     request.thinking, tools=turn.template_tools)
            answer = service.answer(question,
                                    on_text=(lambda s: self.text.emit(rid, s)) if stream
                                    else None,
                                    on_step=on_step if stream else None,
                                    should_stop=lambda: self._should_stop(rid), plain=plain)
            engine = service.engine
            assert engine is not None
            texts, kinds = _token_kinds(engine.target, answer.result)
        result = answer.result
        read = syntax.read(result.text, list(request.tools)) \
            if request.tools and result.finish_reason != "cancelled" else None
        return GenerationOutcome(rid, result.text, result.finish_reason, result.stats,
                                 t_start, texts, kinds, answer.n_dropped,
                                 tuple(read.calls) if read else (),
                                 read.content if read else None)

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.discard(request_id)

    def _close_engine(self) -> None:
        with self.engine_lock:
            if self._service is not None:
                for hook in self.before_close:  # what holds native state of this model
                    hook()
                self._service.close()
                self._service = None


def _token_kinds(target: Target, result: GenerationResult
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split the answer per token and say who produced each: the first token and each
    step's last one are the target's own; the ones before it were accepted drafts."""
    kinds = ["target"]
    for s in result.stats.steps:
        kinds += ["draft"] * s.n_accepted + ["target"]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = tuple(decoder.decode(target.token_bytes(t)) for t in result.tokens)
    return texts, tuple(kinds[:len(texts)])


def _failure(request_id: int, exc: Exception) -> EngineFailure:
    failure = failure_of(exc)
    if failure.kind == "worker_lost":
        return EngineFailure(request_id, "worker", f"{failure.message}. The answer stopped "
                             "here; the model reopens on this machine if it fits")
    kind = "engine" if failure.kind == "worker" else failure.kind
    return EngineFailure(request_id, kind, failure.message)


def _max_ctx(engine: object) -> int:
    """The largest context this engine could be reloaded with for documents, its whole
    need counted (app.gui.context_room); its own for an engine in another process."""
    target = engine.target  # type: ignore[attr-defined]
    if loaded_memory(engine) is None:
        return target.n_ctx
    return largest_context(
        lambda n: engine_memory(engine.model, target, engine.setup.spec,  # type: ignore[attr-defined]
                                engine.config.draft_model, n),  # type: ignore[attr-defined]
        engine.model, engine.hardware, target.n_ctx,  # type: ignore[attr-defined]
        target.n_gpu_layers, bool(engine.config.workers))  # type: ignore[attr-defined]


def _memory_text(engine: object) -> str:
    """``1.2 GiB (weights ..., KV cache ...)``, or nothing for a model on workers."""
    need = loaded_memory(engine)
    return need.describe() if need is not None else ""
