"""One engine, one request at a time: a bounded queue in front of it and a thread that
runs the queued requests in order.

The engine answers through its ``AnswerService`` (engine.conversation), reached through
``service_of()`` under ``lock``: ``tandem serve`` gives its own service and a fresh lock;
the desktop app gives its worker's service and the lock the worker holds while it
generates, so chat and API requests never run at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from app.server.schema import ApiError, CompletionRequest
from engine.conversation import AnswerService, Elsewhere, Question, failure_of
from engine.decoding.generation import GenerationConfig, GenerationResult
from engine.decoding.logprobs import TokenLogprob

log = logging.getLogger(__name__)


@dataclass
class Job:
    """A validated request. ``emit(kind, value)`` is called in the lane's thread with
    ("start", prompt tokens), ("text", delta)..., then ("done", GenerationResult) or
    ("error", ApiError); ``cancelled`` is polled between steps (a client that left)."""

    request: CompletionRequest
    emit: Callable[[str, object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_queued: float = field(default_factory=time.perf_counter)
    t_started: float = 0.0

    @property
    def queue_wait_s(self) -> float:
        return max(0.0, self.t_started - self.t_queued) if self.t_started else 0.0


class JobQueue:
    """The bounded queue in front of an engine: ``submit`` raises ApiError 429 when
    ``max_waiting`` jobs are already waiting."""

    def __init__(self, max_waiting: int) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_waiting)
        self.max_waiting = max_waiting
        self.counts = {"answered": 0, "cancelled": 0, "failed": 0}  # for /health

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ApiError(429, f"Tandem is busy: {self.max_waiting} requests are already "
                                "waiting for the model; retry shortly",
                           code="queue_full", kind="rate_limit_error") from None

    @property
    def n_waiting(self) -> int:
        return self._queue.qsize()

    def _turn_away_waiting(self) -> None:
        """Tell every waiting job's client the server is shutting down (on close)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancelled.set()
                job.emit("error", ApiError(503, "the server is shutting down",
                                           kind="server_error"))


def question_of(job: Job) -> Question:
    """The engine's question for a request: its messages or text, and how to answer."""
    req = job.request
    config = GenerationConfig(max_tokens=req.max_tokens, sampling=req.sampling,
                              stop=req.stop, grammar=req.grammar, logprobs=req.logprobs,
                              prediction=req.prediction)
    return (Question.chat(list(req.messages), config, req.context_policy,
                          req.enable_thinking, req.template_tools)
            if req.is_chat else Question.completion(req.prompt or "", config))


class EngineLane(JobQueue):
    """Runs jobs one by one. ``submit`` raises ApiError 429 when ``max_waiting`` jobs are
    already waiting (one more may be running).

    Every llama.cpp call must come from the thread that made the engine: with llama.cpp's
    OpenMP build, a decode from another thread runs far slower (docs/benchmarks.md:
    figures behind the code's rules, "The API"). So jobs run where the engine lives:
    ``own_thread`` False runs them in the caller's ``run_forever`` (``tandem serve``:
    the main thread), and ``execute(fn)`` hands each one to the engine's thread (the
    app's worker) and waits for it.
    """

    def __init__(self, service_of: Callable[[], AnswerService | None],
                 lock: AbstractContextManager, max_waiting: int = 8,
                 own_thread: bool = True,
                 execute: Callable[[Callable[[], GenerationResult]], GenerationResult]
                 | None = None) -> None:
        super().__init__(max_waiting)
        self._service_of = service_of
        self._lock = lock
        self._execute = execute or (lambda fn: fn())
        self._running: Job | None = None
        self._thread: threading.Thread | None = None
        if own_thread:
            self._thread = threading.Thread(target=self.run_forever, name="tandem-api-lane",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel what waits and what runs (it stops at its next step and its client
        gets what was written), stop the thread."""
        running = self._running
        if running is not None:
            running.cancelled.set()
        self._turn_away_waiting()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run_forever(self) -> None:
        """Run jobs until ``close``."""
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                self.counts["cancelled"] += 1
                job.emit("error", ApiError(499, "the client went away"))
                continue
            job.t_started = time.perf_counter()
            self._running = job
            try:
                result = self._execute(lambda job=job: self._run(job))
            except Exception as exc:  # noqa: BLE001 - every failure reaches its client
                self.counts["failed"] += 1
                job.emit("error", _api_error(exc))
            else:
                self.counts["cancelled" if result.finish_reason == "cancelled"
                            else "answered"] += 1
                job.emit("done", result)
            finally:
                self._running = None

    def _run(self, job: Job) -> GenerationResult:
        with self._lock:
            service = self._service_of()
            if service is None or service.current() is None:
                raise ApiError(503, "no model is loaded", kind="server_error")
            return answer_job(service, job)


def answer_job(service: AnswerService, job: Job, elsewhere: Elsewhere | None = None
               ) -> GenerationResult:
    """``job`` answered through ``service`` (decoded ``elsewhere`` where given: a parallel
    lane), its events emitted: "start" once the prompt fits, then its text (batched when
    it streams)."""
    batcher = _TextBatcher(job.emit) if job.request.stream else None
    answer = service.answer(question_of(job),
                            on_start=lambda n_prompt, _dropped: job.emit("start", n_prompt),
                            on_text=batcher.add if batcher else None,
                            should_stop=job.cancelled.is_set,
                            on_logprobs=batcher.logprobs_hook(job) if batcher else None,
                            elsewhere=elsewhere)
    if batcher is not None:
        batcher.flush()
    return answer.result


class _TextBatcher:
    """Text deltas for a stream, at most one event per ``interval_s``. Waking the HTTP
    thread for every token costs the generation: on a 2-core laptop whose cores both
    run llama.cpp, each wake-up preempts a decode thread (docs/benchmarks.md: figures
    behind the code's rules, "The API")."""

    def __init__(self, emit: Callable[[str, object], None], interval_s: float = 0.05) -> None:
        self._emit, self._interval_s = emit, interval_s
        self._parts: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._t_last = 0.0

    def add_logprobs(self, logprobs: list[TokenLogprob]) -> None:
        """The log probabilities of the tokens the next text ends: sent with it."""
        self._logprobs.extend(logprobs)

    def add(self, text: str) -> None:
        self._parts.append(text)
        now = time.perf_counter()
        if now - self._t_last >= self._interval_s:
            self.flush()
            self._t_last = now

    def flush(self) -> None:
        if self._parts:
            if self._logprobs:
                self._emit("logprobs", list(self._logprobs))
                self._logprobs.clear()
            self._emit("text", "".join(self._parts))
            self._parts.clear()

    def logprobs_hook(self, job: Job) -> Callable[[list[TokenLogprob]], None] | None:
        """``add_logprobs`` where the request asked for log probabilities."""
        return self.add_logprobs if job.request.logprobs is not None else None


# The HTTP status of each kind of failure (engine.conversation.Failure): a lost worker's
# next request runs on this machine if it can.
_STATUS = {"context": 400, "sampling": 400, "worker_lost": 503, "worker": 503,
           "engine": 500, "internal": 500}


def _api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    failure = failure_of(exc)
    if failure.kind == "context":
        return ApiError(400, failure.message, code="context_length_exceeded")
    message = (f"internal error: {failure.message}" if failure.kind == "internal"
               else failure.message)
    status = _STATUS[failure.kind]
    return ApiError(status, message, kind="invalid_request_error" if status == 400
                    else "server_error")
