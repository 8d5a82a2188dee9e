"""Several requests at once (``tandem serve --parallel N``): N answers decoded together on
one model (engine.decoding.parallel), a bounded queue in front of them.

Each request runs ``generate`` on its own thread over a lane; every llama.cpp call runs
in ``run_forever``, on the thread that made the engine. In the desktop app that thread
also answers the chat, so ``execute`` hands it the lanes' work in bursts, while any is
waiting, under the engine lock (the chat's answers go between bursts). The queue, its
429 and the figures for /health are as in EngineLane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import psutil

from app.server.lane import Job, JobQueue, _api_error, answer_job
from app.server.schema import ApiError
from engine.conversation import AnswerService, Elsewhere, Generates
from engine.decoding.generation import GenerationConfig, GenerationResult, generate
from engine.decoding.logprobs import TokenLogprob
from engine.decoding.parallel import LaneTarget, ParallelLanes
from engine.decoding.stats import StepStats
from engine.planning.memory_plan import lanes_memory, lanes_that_fit
from engine.session import Engine

log = logging.getLogger(__name__)


def lanes_allowed(engine: object, asked: int) -> tuple[int, str]:
    """How many answers the engine may decode together, and why not more: as many as
    asked where its verified batches are exact (a lane's row then gets one-token
    decoding's logits), as many as a verification may take where the probe limited it,
    one where it failed, the model keeps recurrent state, or runs in another process."""
    if asked <= 1:
        return 1, ""
    if not isinstance(engine, Engine):
        return 1, "the model runs in another process (workers): one answer at a time"
    kernels, target = engine.kernels, engine.target
    if not target.arch.trees:
        return 1, "this model keeps recurrent state per sequence: one answer at a time"
    if target.arch.n_swa:
        return 1, ("this model's sliding-window cache is two caches, which lanes do not "
                   "take yet: one answer at a time")
    # The probe's verdict where the target runs (the GPU's once a layer is there).
    if kernels is None or not engine.verifies_exactly:
        return 1, ("batches of this model's tokens do not sum as one token does here, so "
                   "answers decoded together would differ from their answers alone: one "
                   "at a time")
    n, why = asked, ""
    if kernels.max_batch is not None and kernels.max_batch < asked:
        n, why = kernels.max_batch, (f"at most {kernels.max_batch} answers together: "
                                     "batches of more rows sum in another order with these "
                                     "kernels")
    c = target.config
    if c.n_gpu_layers:  # the lanes' cache sits with the layers (not measured there)
        return n, why
    fit = lanes_that_fit(engine.model, target.n_ctx, c.type_k, c.type_v, n,
                         psutil.virtual_memory().available)
    if fit < n:
        one = lanes_memory(engine.model, target.n_ctx, c.type_k, c.type_v, 1)
        return max(1, fit), (f"{'one answer' if fit <= 1 else f'{fit} answers'} at a time: "
                             f"each lane holds a {target.n_ctx}-token cache of its own "
                             f"({one / 2**30:.2f} GiB with its buffers for one), and the "
                             "memory left after the model loaded holds no more")
    return n, why


class ParallelEngineLane(JobQueue):
    """Runs up to ``n_lanes`` jobs at once on the engine ``service_of()`` gives (one in
    this process). ``submit`` raises ApiError 429 when ``max_waiting`` jobs wait."""

    def __init__(self, service_of: Callable[[], AnswerService | None], max_waiting: int,
                 n_lanes: int,
                 execute: Callable[[Callable[[], object]], object] | None = None,
                 lock: AbstractContextManager | None = None) -> None:
        """``execute(fn)``: runs ``fn`` on the engine's thread and waits (the app's
        worker); None when the caller gives that thread to ``run_forever``. ``lock``:
        held around each burst of the lanes' work there."""
        service = service_of()
        engine = service.current() if service is not None else None
        if service is None or engine is None:
            raise ValueError("no model is loaded")
        if not isinstance(engine, Engine):  # lanes_allowed gives it one answer at a time
            raise ValueError("lanes decode on a model in this process only")
        super().__init__(max_waiting)
        self._service = service
        self._execute = execute
        self._lock = lock or nullcontext()
        target = engine.target
        make = lambda: ParallelLanes(target, n_lanes)  # noqa: E731
        self.lanes: ParallelLanes = make() if execute is None else execute(make)  # type: ignore[assignment]
        self._counts_lock = threading.Lock()
        self._running: dict[int, Job] = {}  # by id: jobs are not hashable
        self._threads = [threading.Thread(target=self._work, name=f"tandem-api-lane-{i}",
                                          daemon=True) for i in range(self.lanes.n_lanes)]
        if execute is not None:
            self._threads.append(threading.Thread(target=self._hand_work_over,
                                                  name="tandem-api-lanes-native", daemon=True))
        for t in self._threads:
            t.start()

    def _hand_work_over(self) -> None:
        """While the lanes have work, run it on the engine's thread, a burst at a time."""
        assert self._execute is not None
        while True:
            self.lanes.work_ready.wait()
            if not self._execute(self._burst):
                break  # closed
        self._execute(self.lanes.free)

    def _burst(self) -> bool:
        with self._lock:
            return self.lanes.serve_until_quiet()

    def abandon(self) -> None:
        """The model is about to close: on the engine's thread, between bursts. What
        runs and waits is answered with an error and the lanes' context freed now."""
        for job in list(self._running.values()):
            job.cancelled.set()
        self._turn_away_waiting()
        self.lanes.close()
        self.lanes.fail_what_waits()
        self.lanes.free()

    def run_forever(self) -> None:
        """The native work of every lane, until ``close``; on the engine's thread."""
        self.lanes.serve_forever()
        self.lanes.free()

    def close(self, timeout_s: float = 2.0) -> None:
        """Cancel what runs and what waits, and stop ``run_forever``. At shutdown only
        (``tandem serve``): a job still running when the native thread has stopped waits
        forever, so its thread (a daemon) is given ``timeout_s`` in all, then left."""
        for job in list(self._running.values()):
            job.cancelled.set()
        self._turn_away_waiting()
        for _ in range(self.lanes.n_lanes):
            self._queue.put(None)
        self.lanes.close()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self.counts[key] += 1

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():
                self._count("cancelled")
                job.emit("error", ApiError(499, "the client went away"))
                continue
            job.t_started = time.perf_counter()
            self._running[id(job)] = job
            lane: LaneTarget | None = None
            try:
                lane = self.lanes.lane()
                result = self._run(job, lane)
            except Exception as exc:  # noqa: BLE001 - every failure reaches its client
                self._count("failed")
                job.emit("error", _api_error(exc))
            else:
                self._count("cancelled" if result.finish_reason == "cancelled"
                            else "answered")
                job.emit("done", result)
            finally:
                if lane is not None:
                    lane.release()
                self._running.pop(id(job), None)

    def _run(self, job: Job, lane: LaneTarget) -> GenerationResult:
        """``job`` through the one answer path (``AnswerService.answer``: the prompt and
        its checks on the engine's thread), decoded in ``lane``."""
        return answer_job(self._service, job, Elsewhere(self.lanes.run, _generate_in(lane)))


def _generate_in(lane: LaneTarget) -> Generates:
    """``Engine.generate``'s call, decoded in ``lane``: without a drafter (none runs in
    lanes), so every answer there is plain decoding whatever ``plain`` says."""
    def generate_in_lane(prompt: list[int], config: GenerationConfig | None = None, *,
                         on_text: Callable[[str], None] | None = None,
                         on_step: Callable[[StepStats], None] | None = None,
                         should_stop: Callable[[], bool] | None = None,
                         plain: bool = False,
                         on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
                         ) -> GenerationResult:
        return generate(lane, prompt, None, config, on_text=on_text, on_step=on_step,
                        should_stop=should_stop, on_logprobs=on_logprobs)
    return generate_in_lane
