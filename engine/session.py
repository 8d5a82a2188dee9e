"""The engine: one object that owns the target, the drafter, the cost model, the
governor and the plan.

Built in a fixed order:

1. probe the hardware;
2. read the model's facts from its GGUF header (no weights loaded), and set the target
   up (engine.planning.target_setup), with the CPU kernels that make verified batches
   exact (engine.planning.kernels: probed once per model file, cached);
3. decide what to run (a ``Setup``, engine.planning.first_setup): plain decoding where
   speculation cannot be exact, the drafter asked for by name (a ``DrafterKind``,
   engine.drafters.kinds), or (``auto``) the plan priced from this machine's measured
   costs (engine.planning.plan_maker);
4. open the target once, where the setup puts it (the CPU, with a note, if the GPU
   refuses), and check its first forward pass;
5. ``apply``: the one method that makes the engine run a setup, at start and at every
   re-plan (target placement, state snapshots, drafter, budget, governor).

The front ends answer through ``engine.conversation`` (fit, generate, errors), which
calls ``Engine.fit_chat`` and ``Engine.generate``; docs/engine.md follows one message
through.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.decoding.budget import (
    MAX_DRAFT_LIMIT,
    TILED_ROW_SHARE,
    SpeculationGovernor,
    VerifyCostModel,
    context_bucket,
)
from engine.decoding.generation import GenerationConfig, GenerationResult, generate
from engine.decoding.grammar import Grammar
from engine.decoding.logprobs import TokenLogprob
from engine.decoding.stats import StepStats
from engine.drafters import memory_file, open_drafter
from engine.drafters.base import Drafter
from engine.drafters.kinds import CHOICES, DrafterKind, Need
from engine.drafters.memory_file import MemoryFile
from engine.drafters.prediction import PredictionDrafter
from engine.drafters.suffix_index import SuffixIndex
from engine.errors import InvalidSettingError, ModelLoadError, TandemError
from engine.hub.model_store import data_dir, default_model_path, default_model_ready
from engine.planning.calibration import CostProfile
from engine.planning.draft_record import DraftRecord
from engine.planning.drafter_follow import governor_for, record_key
from engine.planning.first_setup import first_setup
from engine.planning.memory_plan import engine_memory
from engine.planning.plan_check import PlanCheck, same_choice
from engine.planning.plan_log import PlanEvent
from engine.planning.plan_maker import PlanMaker, Setup
from engine.planning.planner import Overrides, Plan
from engine.planning.prediction_budget import prediction_budget, verifies_exactly
from engine.planning.target_setup import target_settings
from engine.planning.thread_choice import ThreadFollower
from engine.runtime.architecture import RS_ROLLBACK_TOKENS
from engine.runtime.chat_template import OWN_TEMPLATE
from engine.runtime.context_fit import DEFAULT_POLICY, FittedPrompt, fit_messages
from engine.runtime.hardware import HardwareProfile, check_device, default_threads, probe_hardware
from engine.runtime.kv_cache import KV_MODES, KV_TRADE_OFF
from engine.runtime.memory_fit import MemoryNeed
from engine.runtime.model_info import ModelInfo, read_model_info
from engine.runtime.native import prompt_kernels_available
from engine.runtime.native_policy import tiled_cpu_attention
from engine.runtime.target import Target
from engine.workers.endpoints import parse_endpoint
from engine.workers.handshake import WorkerInfo, probe_worker

log = logging.getLogger(__name__)

ENGINE_DRAFTERS = CHOICES  # "auto" and every drafter's name (engine.drafters.kinds)
# Room for a chat prompt and an answer, and for the largest verification batch.
MIN_CTX = 64
DEFAULT_CTX = 4096


@dataclass(frozen=True)
class EngineConfig:
    """What to load. ``model_path`` None: the bundled model (prepared on first use);
    ``head_dir`` None: the head shipped for the bundled model (used when it fits)."""

    model_path: Path | None = None
    drafter: DrafterKind = DrafterKind.AUTO  # AUTO (the planner decides), a kind or its name
    head_dir: Path | None = None
    head_device: str = "cpu"  # where a head asked for by name runs
    overrides: Overrides = field(default_factory=Overrides)
    n_ctx: int | None = None  # None: DEFAULT_CTX, or the model's trained context if less
    n_threads: int | None = None  # None: one per physical core
    recalibrate: bool = False
    cache_dir: Path | None = None  # calibration cache; None: the data directory's
    memory_dir: Path | None = None  # drafts' memory per model; None: the data directory's
    kv_cache: str = "exact"  # "exact" or "fast" (engine.runtime.kv_cache.KV_TRADE_OFF says how)
    # Flash attention on or off; None: the rule (engine.runtime.native_policy, off on this
    # machine's CPU with the exact cache, on elsewhere), as llama-server's -fa auto.
    flash_attn: bool | None = None
    draft_model: Path | None = None  # the GGUF a draft model drafter runs
    # Workers (HOST:PORT, `tandem worker`) for the target's layers and KV cache; open such
    # an engine with engine.session_process.open_engine (a child process).
    workers: tuple[str, ...] = ()
    worker_layers: int | None = None  # None: as many as the workers' free memory holds

    def __post_init__(self) -> None:
        """Every setting checked before anything loads; the message names the value and
        the range."""
        kind = DrafterKind.of(self.drafter)
        if kind is None:
            raise InvalidSettingError("drafter", f"must be one of {', '.join(ENGINE_DRAFTERS)}",
                                      self.drafter)
        object.__setattr__(self, "drafter", kind)
        check_device(self.head_device)
        if Need.DRAFT_GGUF in kind.needs and self.draft_model is None:
            raise InvalidSettingError("draft_model", f"must name a GGUF for the {kind} drafter",
                                      None)
        if self.kv_cache not in KV_MODES:
            raise InvalidSettingError("kv_cache", f"must be one of {', '.join(KV_MODES)}",
                                      self.kv_cache)
        if self.n_ctx is not None and (not isinstance(self.n_ctx, int) or self.n_ctx < MIN_CTX):
            raise InvalidSettingError("n_ctx", f"must be at least {MIN_CTX} tokens", self.n_ctx)
        n_cores = os.cpu_count() or 1
        if self.n_threads is not None and not 1 <= self.n_threads <= n_cores:
            raise InvalidSettingError("n_threads", f"must be between 1 and {n_cores} (this "
                                      "machine's logical cores)", self.n_threads)
        for endpoint in self.workers:
            parse_endpoint(endpoint)
        if self.worker_layers is not None and self.worker_layers < -1:
            raise InvalidSettingError("worker_layers", "must be -1 (all) or a layer count",
                                      self.worker_layers)
        if self.overrides.depth is not None and not 1 <= self.overrides.depth <= MAX_DRAFT_LIMIT:
            raise InvalidSettingError("depth", f"must be between 1 and {MAX_DRAFT_LIMIT}",
                                      self.overrides.depth)


class Engine:
    """A loaded model ready to generate. A context manager; ``close()`` is idempotent."""

    def __init__(self, config: EngineConfig | None = None,
                 progress: Callable[[str], None] | None = None,
                 hardware: HardwareProfile | None = None) -> None:
        """Raises ModelLoadError (the model cannot load), ValueError (bad settings)."""
        self.config = config = config or EngineConfig()
        say = progress or (lambda _msg: None)
        self.notes: list[str] = []
        path = config.model_path
        if path is None:
            if not default_model_ready():
                say("preparing the bundled model (first start only)")
            path = default_model_path()
        self.hardware = hardware or probe_hardware()
        self.model: ModelInfo = read_model_info(path)
        # Threads asked for stay; else each answer decodes with the cores other programs
        # leave (engine.planning.thread_choice), and the start (the kernel probe, a first
        # measurement) with what a quick look leaves now: on a busy machine, one thread
        # that runs beats two that wait for each other.
        self.threads = ThreadFollower(default_threads()) if config.n_threads is None \
            else None
        self.n_threads = config.n_threads or self.threads.at_start().n_threads
        # Asked before llama.cpp connects: it aborts the process on a failed handshake.
        self.workers: tuple[WorkerInfo, ...] = tuple(probe_worker(w) for w in config.workers)
        self.plans = PlanMaker(self.model, self.hardware, self.n_threads, config.overrides,
                               self._cache_dir(), self.notes)
        self._target_config, self.kernels = target_settings(
            config, self.model, context_length(config, self.model), self.n_threads,
            self.workers, self._cache_dir(), say, self.notes, self.hardware)
        # What runs; ``apply`` sets them all, in its one order.
        self.setup = Setup.plain()
        self.plan: Plan | None = None
        self.drafter: Drafter | None = None
        self.max_draft = 0
        self.governor: SpeculationGovernor | None = None
        self.pinned = False  # drafting decisions no longer follow timings (pin_drafting)
        self._draft_pair: str | None = None  # the record a draft model's steps correct
        self.memory: SuffixIndex | None = None  # opened for the first drafter that reads it
        self._memory_file: MemoryFile | None = None
        setup, opened, why = first_setup(config, self.model, self.kernels, self.plans,
                                         self._target_config, say, self.notes)
        self.target = self._place_target(setup.gpu_layers, opened)
        self._placed_for = setup.gpu_layers  # asked of the target (the GPU may refuse)
        try:
            check_first_forward(self.target)
            self.notes += target_notes(self.model.path.name, self.target)
            self.apply(setup, why)
        except BaseException:
            self.close()
            raise
        # The budget starts from the calibrated curve where there is one and learns on.
        costs = self.plans.costs
        curve = costs.verify_s.get(target_device(self.target)) if costs is not None else None
        self.cost = VerifyCostModel.from_curve(curve) if curve else VerifyCostModel()
        if tiled_cpu_attention(self.target.flash_attn, self.target.n_gpu_layers,
                               self.target.model.n_layer):
            self.cost.row_share = TILED_ROW_SHARE
        if self.plan is not None:
            self.plans.watch(self.plan, target_device(self.target))
        if self.threads is not None:
            self.threads.idle()

    # --- building, in order ------------------------------------------------------------
    def _place_target(self, gpu_layers: int, opened: Target | None) -> Target:
        """The target with ``gpu_layers`` offloaded: ``opened`` when it already is, else
        a new one (and the CPU with a note when the GPU refuses)."""
        if opened is not None and opened.n_gpu_layers == gpu_layers:
            return opened
        if opened is not None:
            opened.close()
        try:
            return Target(self.model.path, replace(self._target_config,
                                                   n_gpu_layers=gpu_layers))
        except TandemError as exc:
            if gpu_layers == 0:
                raise
            self.notes.append(f"the GPU could not take the model ({exc}); it runs on the CPU")
            return Target(self.model.path, self._target_config)

    # --- the one way to run a setup --------------------------------------------------------
    def apply(self, setup: Setup, why: str | None = None) -> None:
        """Make the engine run ``setup`` (between answers: nothing in flight), always in
        this order:

        1. the drafter in use closes (its contexts may hold the target's);
        2. the target moves where the setup puts it (reopened only if it must);
        3. the budget is capped by what the target can verify and take back;
        4. a hybrid's recurrent state keeps snapshots for that budget, none without
           drafts (every decode writes each one);
        5. the drafter opens, with the memory of earlier answers where it reads it;
        6. the governor and the draft record follow the drafter;
        7. a plan's change is logged with ``why``.
        """
        self._detach_drafter()
        if setup.gpu_layers != self._placed_for:  # a target the GPU refused stays put
            self.target = self._place_target(setup.gpu_layers, self.target)
            self._placed_for = setup.gpu_layers
        target = self.target
        spec = setup.spec
        most = RS_ROLLBACK_TOKENS if target.arch.rs_rollback else 0
        budget = _capped(setup.max_draft, target.max_draft_with(most))
        target.set_state_snapshots(budget if spec.kind.drafts else 0)
        self.max_draft = _capped(budget, target.max_draft)
        if spec.kind.opens_memory and self.memory is None:
            self.memory = self._open_memory()
        self.drafter, notes = open_drafter(spec, target, self.model.fingerprint, self.memory)
        self.notes += notes
        self.setup, self.plan = setup, setup.plan
        self._follow_drafter()
        if setup.plan is not None and why is not None:
            self.plans.log_plan(setup.plan, why)
            log.info("plan: %s (%s)", setup.plan.layout_text(), why)

    def apply_plan(self, plan: Plan, why: str) -> None:
        """Run ``plan`` from the next answer on (``apply`` with its setup)."""
        self.apply(self.plans.setup_for(plan, self.config.overrides.max_draft), why)

    def _follow_drafter(self) -> None:
        """The record and the governor for the drafter now in use."""
        drafter = self.drafter
        # A llama.cpp drafter's steps correct the acceptance the next plan assumes for it.
        self._draft_pair = record_key(self.model.path, drafter)
        # With auto every drafter is governed (engine.planning.drafter_follow); a
        # drafter asked for by name runs as asked.
        self.governor = None
        if self.pinned and drafter is not None:
            drafter.pin()
        elif self.config.drafter is DrafterKind.AUTO and drafter is not None:
            self.governor = governor_for(drafter)

    def pin_drafting(self, slope: float = 0.35) -> None:
        """Pin the drafting decisions that follow this machine's timings, so the same
        actions draft the same tokens on any run (a replayed test case): a fixed
        verification cost curve, no governor pausing ``auto``'s drafter, no dynamic depth
        in a head; held through plan switches. What is answered never depends on them."""
        self.cost = VerifyCostModel(slope=slope, learn=False)
        self.pinned, self.governor = True, None
        if self.drafter is not None:
            self.drafter.pin()

    def _detach_drafter(self) -> None:
        old, self.drafter = self.drafter, None
        if old is not None:
            old.close()

    def _cache_dir(self) -> Path:
        return Path(self.config.cache_dir or data_dir() / "cache")

    def _open_memory(self) -> SuffixIndex:
        """This model's memory of what it wrote before (engine.drafters.memory_file)."""
        self._memory_file = MemoryFile.of_model(
            Path(self.config.memory_dir or data_dir() / memory_file.FOLDER), self.model.path,
            self.model.fingerprint.tokenizer_sha256)
        memory, note = self._memory_file.open()
        self.notes += [note] if note else []
        return memory

    def _save_memory(self) -> None:
        kind = self.drafter.kind if self.drafter is not None else None
        if self.memory is not None and self._memory_file is not None and (
                kind is not None and kind.uses_memory):
            self._memory_file.save(self.memory)

    # --- plans that stay right ----------------------------------------------------------
    @property
    def costs(self) -> CostProfile | None:
        return self.plans.costs

    @property
    def calibrated_now(self) -> bool:
        return self.plans.calibrated_now

    @property
    def remeasure_wanted(self) -> bool:
        """Provisional costs, or a plan the answers changed: measure again when idle."""
        return self.plans.remeasure_wanted

    @property
    def plan_events(self) -> list[PlanEvent]:
        return self.plans.events

    @property
    def plan_check(self) -> PlanCheck | None:
        return self.plans.check

    @plan_check.setter
    def plan_check(self, check: PlanCheck | None) -> None:
        self.plans.check = check

    def _check_plan(self, result: GenerationResult) -> None:
        change = self.plans.check_answer(self.target, result.tokens, result.stats.steps)
        if change is not None:
            self.apply_plan(change.new, change.why)
            self.plans.remeasure_wanted = True  # settle it with a real measurement when idle

    def remeasure(self, progress: Callable[[str], None] | None = None) -> bool:
        """Measure this machine's costs again (between answers; the conversation's cells
        are put back after) and plan from them. A quiet measurement replaces the cached one and the
        plan follows it; a busy one is dropped and the wish to measure stays. Returns
        whether the plan changed."""
        if self.plan is None:
            return False
        say = progress or (lambda _msg: None)
        on_cpu = self.target.n_gpu_layers == 0
        target = self.target if on_cpu else Target(self.model.path, self._target_config)
        # Verifications are measured with every snapshot a plan may keep: a hybrid
        # keeping fewer takes them up, without its drafter (which may hold its context).
        refit = on_cpu and target.arch.rs_rollback and \
            target.state_snapshots < RS_ROLLBACK_TOKENS
        if refit:
            self._detach_drafter()
            target.set_state_snapshots(RS_ROLLBACK_TOKENS)
        # The conversation's cells come back as they were: the next turn parts from them
        # as a session that did not measure would (bit for bit the same first token).
        with target.cache_kept() if on_cpu else contextlib.nullcontext():
            try:
                costs = self.plans.measure(target, self._target_config, say)
            finally:
                if not on_cpu:
                    target.close()
                if refit:  # the setup in use, until a new plan replaces it
                    self.apply(self.setup)
        if costs.provisional:
            return False
        plan = self.plans.keep_measured(costs, self.plan)
        if not same_choice(plan, self.plan):
            self.apply_plan(plan, "costs measured again while the app was idle")
            return True
        # The same choice: the drafter in use stays; a later re-apply takes the new budget.
        self.plan = plan
        self.setup = self.plans.setup_for(plan, self.config.overrides.max_draft)
        return False

    def plan_status(self) -> dict[str, object] | None:
        """When and how the plan's costs were measured, whether they are provisional, the
        last plan change and why, and what the last answer said about the plan."""
        return self.plans.status() if self.plan is not None else None

    # --- use ---------------------------------------------------------------------------
    @property
    def drafter_name(self) -> str:
        """The drafter in use, by its kind's name (``none``: plain decoding)."""
        return self.drafter.name if self.drafter is not None else DrafterKind.NONE

    def chat_prompt(self, messages: list[dict[str, Any]],
                    enable_thinking: bool | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        return self.target.chat_prompt(messages, enable_thinking=enable_thinking, tools=tools)

    def check_grammar(self, gbnf: str) -> None:
        """Raise InvalidSamplingError (naming the problem) when llama.cpp cannot parse
        ``gbnf``: checked before an answer starts, so an API client gets a 400."""
        Grammar.compile(self.target.model, gbnf).close()

    def fit_chat(self, messages: list[dict[str, Any]], max_tokens: int,
                 policy: str = DEFAULT_POLICY, enable_thinking: bool | None = None,
                 tools: list[dict] | None = None) -> FittedPrompt:
        """The prompt for a conversation that may outgrow the context: under
        ``drop_oldest`` the system prompt and the newest turns that leave room for the
        answer (engine.runtime.context_fit); under ``stop`` all of it."""
        return fit_messages(lambda m: self.chat_prompt(m, enable_thinking, tools), messages,
                            self.target.n_ctx, max_tokens, policy)

    def generate(self, prompt: list[int], config: GenerationConfig | None = None, *,
                 on_text: Callable[[str], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 plain: bool = False, remember: bool = True,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
                 ) -> GenerationResult:
        """Generate after ``prompt`` (tokens) with the engine's drafter and budget, or
        with none when ``plain``; the cost model learns across generations, and a drafter
        with memory keeps the answer (saved at once) unless ``remember`` is False.
        Raises what ``engine.decoding.generation.generate`` raises."""
        config = config or GenerationConfig()
        drafter, governor = (None, None) if plain else (self.drafter, self.governor)
        max_draft = 0 if plain else self.max_draft
        predicted = None
        if config.prediction and not plain and self.prediction_budget:
            # A prediction drafts beside the drafter in use, as far as the target verifies
            # exactly; its own calibration trims it, so the governor stays out of it.
            predicted = PredictionDrafter(
                self.target.tokenize(config.prediction, special=False), drafter)
            drafter, governor = predicted, None
            max_draft = max(max_draft, self.prediction_budget)
        config = replace(config, max_draft=max_draft)
        self._follow_the_load()
        # A plain greedy run reports its tokens after it: those after a thread change the
        # tuner made while reading them ran on the old count, and are not its to judge.
        decoded_before_change = False

        def set_threads(n: int) -> None:
            nonlocal decoded_before_change
            self._set_threads(n)
            decoded_before_change = True

        tuner = self.threads.during_answer(set_threads) if self.threads else None

        def step_seen(step: StepStats) -> None:
            nonlocal decoded_before_change
            assert tuner is not None
            if not step.n_proposed and not decoded_before_change:  # one-token steps alike
                tuner.observe(step.t_verify_s, context_bucket(step.n_past))
            if not step.reported_after_s:  # the last of its run: the next run is new
                decoded_before_change = False
            if on_step is not None:
                on_step(step)
        if governor is not None:
            governor.new_request()
        try:
            result = generate(self.target, prompt, drafter, config,
                              on_text=on_text,
                              on_step=step_seen if tuner is not None else on_step,
                              should_stop=should_stop,
                              cost=self.cost, governor=governor,
                              remember=remember, on_logprobs=on_logprobs)
        finally:
            if self.threads is not None:
                self.threads.after_answer(tuner)
                self.threads.idle()
        if not plain and remember:
            self._save_memory()
        if predicted is not None:
            result.stats.n_prediction_accepted = predicted.accepted
            result.stats.n_prediction_rejected = predicted.rejected
            return result  # its steps say how the prediction fared, not the plan
        if not plain and self._draft_pair is not None:
            with contextlib.suppress(OSError):  # a read-only disk must not stop the chat
                DraftRecord(self._cache_dir()).add(self._draft_pair, result.stats.steps)
        if not plain:
            self._check_plan(result)
        return result

    @property
    def prediction_budget(self) -> int:
        """The longest draft a prediction may make where the target runs now."""
        return prediction_budget(self.model.why_plain, self.verifies_exactly,
                                 self.target.n_gpu_layers, self.config.drafter,
                                 self.target.max_draft)

    @property
    def verifies_exactly(self) -> bool:
        """Whether verifying equals one-token decoding where the target runs now."""
        return verifies_exactly(self.kernels.exact if self.kernels is not None else None,
                                self.target.n_gpu_layers, self.plans.gpu_exact)

    def _follow_the_load(self) -> None:
        """The threads for this answer, from the machine's load in the seconds before it."""
        if self.threads is None:
            return
        self._set_threads(self.threads.next_answer().n_threads)

    def _set_threads(self, n: int) -> None:
        """Decode with ``n`` threads from the next step (between steps: the thread count
        does not change a decode's numbers)."""
        self.target.set_threads(n)
        if self.drafter is not None:
            self.drafter.set_threads(n)

    @property
    def threads_text(self) -> str:
        """How many threads decode, and why."""
        if self.threads is None:
            return f"{self.n_threads} threads, as asked"
        return self.threads.choice.why

    @property
    def guarantee(self) -> str:
        """What speculation promises on this model, in words (with the probe's figures)."""
        if self.kernels is None:
            return "plain decoding"
        return self.kernels.describe()

    @property
    def architecture(self) -> dict[str, object]:
        """What this model's architecture lets speculation do (engine.runtime.architecture)."""
        return self.target.arch.table()

    @property
    def kv_cache_text(self) -> str:
        return f"KV cache {self.config.kv_cache}: {KV_TRADE_OFF[self.config.kv_cache]}"

    def describe(self) -> str:
        return describe_engine(self)

    # --- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        if self.threads is not None:
            self.threads.close()
        self._detach_drafter()
        self.target.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def context_length(config: EngineConfig, model: ModelInfo) -> int:
    """The context asked for, checked against what the model was trained for (more would
    give garbage past it); unasked, DEFAULT_CTX or the trained length if less."""
    trained = model.header.context_length
    asked = config.n_ctx
    if asked is None:
        return min(DEFAULT_CTX, trained or DEFAULT_CTX)
    if trained and asked > trained:
        raise InvalidSettingError("n_ctx", f"must be at most {trained} tokens (what "
                                  f"{model.path.name} was trained for)", asked)
    return asked


def target_notes(name: str, target: Target) -> list[str]:
    """What the user should know about the opened target ``name``: prompts read on the
    slower kernels, a base model, a chat format Tandem supplied."""
    notes = []
    if not prompt_kernels_available():
        notes.append("this llama.cpp build lacks Tandem's prompt-kernel switch "
                     "(packaging/llama-cpp/prompt-kernels.patch, applied by make "
                     "install): prompts are read with the exact kernels, slower")
    if target.template.completion:
        # origin: "a base model, as its name or tags say base"
        notes.append(f"{name} is {target.template.origin}: it continues "
                     "your text rather than answering it")
    elif target.template.origin != OWN_TEMPLATE:
        notes.append(f"{name} has no chat template: chat format {target.template.origin}")
    return notes


def target_device(target: Target) -> str:
    """Where the target's verification costs are kept: "gpu" with a layer there."""
    return "gpu" if target.n_gpu_layers else "cpu"


def describe_engine(engine: Engine) -> str:
    """One line: model, threads, and what drafts."""
    how = engine.plan.layout_text() if engine.plan is not None else \
        f"drafter: {engine.drafter_name}"
    if engine.workers and engine.plan is None:  # a plan's layout names them already
        how += "; target on " + ", ".join(w.endpoint for w in engine.workers)
    return f"{engine.model.path.name} ({engine.n_threads} threads; {how})"


def loaded_memory(engine: object) -> MemoryNeed | None:
    """What a loaded engine takes of memory by the plan's rule (engine.planning.
    memory_plan), None for an engine in another process (its target on workers)."""
    if not isinstance(engine, Engine):
        return None
    return engine_memory(engine.model, engine.target, engine.setup.spec,
                         engine.config.draft_model)


def _capped(budget: int, limit: int | None) -> int:
    return budget if limit is None else min(budget, limit)


def check_first_forward(target: Target) -> None:
    """Refuse a model whose first forward pass gives no usable scores: non-finite logits
    (broken weights or quantization), or the same score for every token (weights that
    are zeroed). Such a model would answer garbage with no error."""
    probe = target.tokenize("Hello", special=False) or [0]
    try:
        logits = target.prefill(probe, None).logits
    finally:
        target.reset()
    if not np.all(np.isfinite(logits)):
        raise ModelLoadError(f"{target.path.name} gives non-finite scores (NaN or infinity) "
                             "on its first forward pass: its weights are broken")
    if float(np.max(logits) - np.min(logits)) == 0.0:
        raise ModelLoadError(f"{target.path.name} gives every token the same score on its "
                             "first forward pass: its weights look zeroed or empty")
