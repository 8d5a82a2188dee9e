"""The engine: one object that owns the target, the drafter, the cost model, the
governor and the plan.

Built in a fixed order:

1. probe the hardware;
2. read the model's facts from its GGUF header (no weights loaded), and choose the CPU
   kernels that make verified batches exact (engine.planning.kernels: probed once per
   model file, cached);
3. decide what to run (a ``Setup``): plain decoding where speculation cannot be exact,
   the drafter asked for by name, or (``auto``) the plan priced from this machine's
   measured costs (engine.planning.plan_maker);
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
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.decoding.budget import (
    MAX_DRAFT,
    MAX_DRAFT_LIMIT,
    MAX_MEMORY_DRAFT,
    SpeculationGovernor,
    VerifyCostModel,
    context_bucket,
)
from engine.decoding.generation import GenerationConfig, GenerationResult, generate
from engine.decoding.grammar import Grammar
from engine.decoding.logprobs import TokenLogprob
from engine.decoding.stats import StepStats
from engine.drafters import DRAFTER_NAMES, DrafterSpec, open_drafter
from engine.drafters.base import Drafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.eagle3 import Eagle3Drafter
from engine.drafters.memory import MemoryDrafter
from engine.drafters.merged import MergedDrafter
from engine.drafters.mtp import MtpDrafter
from engine.drafters.suffix_index import SuffixIndex, open_memory
from engine.errors import InvalidSettingError, ModelLoadError, TandemError
from engine.hub.model_store import data_dir, default_model_path, default_model_ready
from engine.planning.calibration import SPOT_SIZES, CalibrationCache, CostProfile, spot_check
from engine.planning.draft_record import DraftRecord, mtp_key, pair_key
from engine.planning.drafter_options import usable_eagle3_head
from engine.planning.kernels import KernelChoice, choose_kernels
from engine.planning.machine_load import count_as_own
from engine.planning.plan_check import PlanChange, PlanCheck, same_choice
from engine.planning.plan_log import PlanEvent
from engine.planning.plan_maker import PlanMaker, Setup
from engine.planning.planner import Overrides, Plan
from engine.planning.thread_choice import ThreadFollower
from engine.runtime.architecture import RS_ROLLBACK_TOKENS
from engine.runtime.chat_template import OWN_TEMPLATE
from engine.runtime.context_fit import DEFAULT_POLICY, FittedPrompt, fit_messages
from engine.runtime.hardware import HardwareProfile, check_device, default_threads, probe_hardware
from engine.runtime.kv_cache import KV_MODES, KV_TRADE_OFF
from engine.runtime.model_info import ModelInfo, read_model_info
from engine.runtime.native import prompt_kernels_available
from engine.runtime.target import Target, TargetConfig
from engine.workers.endpoints import listener_pid, parse_endpoint
from engine.workers.handshake import WorkerInfo, probe_worker
from engine.workers.placement import placement_text, worker_layers

log = logging.getLogger(__name__)

ENGINE_DRAFTERS = ("auto", *DRAFTER_NAMES)
# Room for a chat prompt and an answer, and for the largest verification batch.
MIN_CTX = 64
DEFAULT_CTX = 4096


@dataclass(frozen=True)
class EngineConfig:
    """What to load. ``model_path`` None: the bundled model (prepared on first use);
    ``head_dir`` None: the head shipped for the bundled model (used when it fits)."""

    model_path: Path | None = None
    drafter: str = "auto"  # "auto" (the planner decides) or a name in DRAFTER_NAMES
    head_dir: Path | None = None
    head_device: str = "cpu"  # where a head asked for by name runs
    overrides: Overrides = field(default_factory=Overrides)
    n_ctx: int | None = None  # None: DEFAULT_CTX, or the model's trained context if less
    n_threads: int | None = None  # None: one per physical core
    recalibrate: bool = False
    cache_dir: Path | None = None  # calibration cache; None: the data directory's
    memory_dir: Path | None = None  # drafts' memory per model; None: the data directory's
    kv_cache: str = "exact"  # "exact" or "fast" (engine.runtime.kv_cache.KV_TRADE_OFF says how)
    draft_model: Path | None = None  # the GGUF the "draft" drafter runs
    # Workers (HOST:PORT, `tandem worker`) for the target's layers and KV cache; open such
    # an engine with engine.session_process.open_engine (a child process).
    workers: tuple[str, ...] = ()
    worker_layers: int | None = None  # None: as many as the workers' free memory holds

    def __post_init__(self) -> None:
        """Every setting checked before anything loads; the message names the value and
        the range."""
        if self.drafter not in ENGINE_DRAFTERS:
            raise InvalidSettingError("drafter", f"must be one of {', '.join(ENGINE_DRAFTERS)}",
                                      self.drafter)
        check_device(self.head_device)
        if self.drafter == "draft" and self.draft_model is None:
            raise InvalidSettingError("draft_model", "must name a GGUF for the draft drafter",
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
        self.kernels: KernelChoice | None = None
        self._target_config = self._make_target_config(say)
        # What runs; ``apply`` sets them all, in its one order.
        self.setup = Setup.plain()
        self.plan: Plan | None = None
        self.drafter: Drafter | None = None
        self.max_draft = 0
        self.governor: SpeculationGovernor | None = None
        self.pinned = False  # drafting decisions no longer follow timings (pin_drafting)
        self._draft_pair: str | None = None  # the record a draft model's steps correct
        self.memory: SuffixIndex | None = None
        self._memory_path: Path | None = None
        setup, opened, why = self._first_setup(say)
        self.target = self._place_target(setup.gpu_layers, opened)
        self._placed_for = setup.gpu_layers  # asked of the target (the GPU may refuse)
        try:
            check_first_forward(self.target)
            self._note_what_the_target_is(self.target)
            self.apply(setup, why)
        except BaseException:
            self.close()
            raise
        # The budget starts from the calibrated curve where there is one and learns on.
        costs = self.plans.costs
        curve = costs.verify_s.get(self._target_device) if costs is not None else None
        self.cost = VerifyCostModel.from_curve(curve) if curve else VerifyCostModel()
        if self.plan is not None:
            self.plans.watch(self.plan, self._target_device)
        if self.threads is not None:
            self.threads.idle()

    # --- building, in order ------------------------------------------------------------
    def _make_target_config(self, say: Callable[[str], None]) -> TargetConfig:
        """The target's settings: the context, the cache types, the workers' share, and
        the kernels that keep verified batches exact."""
        config = self.config
        type_k, type_v = KV_MODES[config.kv_cache]
        target_config = TargetConfig(n_ctx=context_length(config, self.model),
                                     n_threads=self.n_threads, type_k=type_k, type_v=type_v,
                                     # No drafts to take back: no state snapshots to pay.
                                     state_snapshots=config.drafter != "none")
        for endpoint in config.workers:  # a worker on these cores computes for us
            pid = listener_pid(endpoint)
            if pid is not None:
                count_as_own(pid)
        if self.workers:
            target_config = replace(
                target_config, workers=config.workers,
                worker_layers=worker_layers(self.model, self.workers, target_config,
                                            config.worker_layers),
                # An EAGLE-3 head uses the target's LM head.
                output_here=config.drafter == "eagle3")
            self.notes.append(placement_text(self.model, self.workers, target_config))
        # Plain decoding runs on the kernels speculation would use, so an answer does not
        # depend on the drafter (docs/benchmarks.md: exact kernels).
        if self.model.why_plain is None:
            self.kernels = choose_kernels(self.model.path, target_config, self.n_threads,
                                          CalibrationCache(self._cache_dir()), say)
            target_config = replace(target_config, repack=self.kernels.repack,
                                    max_batch=self.kernels.max_batch)
        return target_config

    def _first_setup(self, say: Callable[[str], None]
                     ) -> tuple[Setup, Target | None, str | None]:
        """What to run first, the target already opened for it (auto may have opened one
        to measure), and why (for the plan's log)."""
        config, name = self.config, self.model.path.name
        if self.model.why_plain is not None:  # known before any probe or measurement
            if config.drafter != "none":
                self.notes.append(f"{name} decodes plainly: {self.model.why_plain}")
            return Setup.plain(), None, None
        if config.drafter == "auto" and self.kernels is not None and not self.kernels.exact:
            self.notes.append(f"auto does not speculate on {name}: "
                              f"{self.kernels.describe()}. Choose a drafter by name to "
                              "speculate anyway")
            return Setup.plain(), None, None
        if config.drafter == "auto":
            self.plans.gather_options(config.head_dir, config.draft_model,
                                      self._target_config)
            plan, opened = self.plans.plan_at_start(self._target_config, config.recalibrate,
                                                    say)
            return (self.plans.setup_for(plan, config.overrides.max_draft), opened,
                    self.plans.start_why)
        return self._asked_setup(), None, None

    def _asked_setup(self) -> Setup:
        """The drafter asked for by name, on the CPU, with the budget asked (or the
        drafter's default)."""
        config = self.config
        options: dict[str, object] = {}
        if config.overrides.depth:
            options["depth"] = config.overrides.depth
        head_dir = config.head_dir
        if config.drafter == "eagle3" and head_dir is None:
            # An imported head that fits this model, else the bundled model's.
            head_dir = usable_eagle3_head(self.model)
        spec = DrafterSpec(config.drafter, head_dir, config.head_device, options,
                           config.draft_model)
        cap = MAX_MEMORY_DRAFT if config.drafter in ("memory", "head+memory") else MAX_DRAFT
        asked = config.overrides.max_draft
        return Setup(0, spec, cap if asked is None else asked)

    def _note_what_the_target_is(self, target: Target) -> None:
        name = self.model.path.name
        if not prompt_kernels_available():
            self.notes.append("this llama.cpp build lacks Tandem's prompt-kernel switch "
                              "(packaging/llama-cpp/prompt-kernels.patch, applied by make "
                              "install): prompts are read with the exact kernels, slower")
        if target.template.completion:
            # origin: "a base model, as its name or tags say base"
            self.notes.append(f"{name} is {target.template.origin}: it continues "
                              "your text rather than answering it")
        elif target.template.origin != OWN_TEMPLATE:
            self.notes.append(f"{name} has no chat template: chat format "
                              f"{target.template.origin}")

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
        target.set_state_snapshots(0 if spec.name == "none" else budget)
        self.max_draft = _capped(budget, target.max_draft)
        if spec.name not in ("none", "lookup") and self.memory is None:
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
        """The pair record and the governor for the drafter now in use."""
        config, drafter = self.config, self.drafter
        # A draft model's steps correct the acceptance the next plan assumes for the pair.
        self._draft_pair = (pair_key(self.model.path, config.draft_model)
                            if isinstance(drafter, DraftModelDrafter)
                            and config.draft_model is not None else
                            mtp_key(self.model.path) if isinstance(drafter, MtpDrafter)
                            else pair_key(self.model.path, drafter.path)
                            if isinstance(drafter, Eagle3Drafter) else None)
        # With auto every drafter is governed: a head or draft model whose drafts cost
        # time and are not accepted is paused and probed again. Drafts from memory cost
        # microseconds and their hits come in bursts: they are let off 5% of a token and
        # paused 32 steps at most, so a repeat is not missed for long. A drafter asked
        # for by name runs as asked.
        self.governor = None
        if self.pinned:
            self._pin_drafter()
        elif config.drafter == "auto" and drafter is not None:
            self.governor = (SpeculationGovernor() if drafter.is_draft_model else
                             SpeculationGovernor(tolerance=0.05, max_pause=32))

    def pin_drafting(self, slope: float = 0.35) -> None:
        """Pin the drafting decisions that follow this machine's timings, so the same
        actions draft the same tokens on any run (a replayed test case): a fixed
        verification cost curve, no governor pausing ``auto``'s drafter, no dynamic depth
        in a head; held through plan switches. What is answered never depends on them."""
        self.cost = VerifyCostModel(slope=slope, learn=False)
        self.pinned, self.governor = True, None
        self._pin_drafter()

    def _pin_drafter(self) -> None:
        drafter = self.drafter
        config = getattr(drafter, "config", None)
        if dataclasses.is_dataclass(config) and getattr(config, "dynamic_depth", False):
            drafter.config = dataclasses.replace(config, dynamic_depth=False)  # type: ignore[union-attr]

    def _detach_drafter(self) -> None:
        old, self.drafter = self.drafter, None
        if old is not None:
            old.close()

    def _cache_dir(self) -> Path:
        return Path(self.config.cache_dir or data_dir() / "cache")

    def _open_memory(self) -> SuffixIndex:
        """This model's memory of what it wrote before (a missing or unusable file means
        an empty memory, and a note when the file was unusable)."""
        fp = self.model.fingerprint
        directory = Path(self.config.memory_dir or data_dir() / "memory")
        self._memory_path = directory / f"{self.model.path.stem}-{fp.tokenizer_sha256[:12]}.idx"
        memory, note = open_memory(self._memory_path, tag=fp.tokenizer_sha256)
        if note:
            self.notes.append(note)
        return memory

    def _save_memory(self) -> None:
        if self.memory is None or self._memory_path is None or not isinstance(
                self.drafter, MemoryDrafter | MergedDrafter):
            return
        try:
            self._memory_path.parent.mkdir(parents=True, exist_ok=True)
            self.memory.save(self._memory_path)
        except OSError as exc:  # a full or read-only disk must not stop the chat
            log.warning("could not save the draft memory to %s: %s", self._memory_path, exc)

    # --- plans that stay right ----------------------------------------------------------
    @property
    def _target_device(self) -> str:
        return "gpu" if self.target.n_gpu_layers else "cpu"

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
        check = self.plans.check
        if check is None:
            return
        target, tokens = self.target, result.tokens

        def spot() -> dict[int, float]:
            # The answer's last token is not cached yet: it is the root of the checks.
            if not tokens or target.n_ctx - target.n_used <= max(SPOT_SIZES) + 1:
                return {}
            return spot_check(target, tokens[-1], tokens[-max(SPOT_SIZES):])

        change: PlanChange | None = check.observe(result.stats.steps, spot)
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
        """The drafter in use: "head", "lookup" or "none"."""
        return self.drafter.name if self.drafter is not None else "none"

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
        config = replace(config or GenerationConfig(),
                         max_draft=0 if plain else self.max_draft)
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
        try:
            result = generate(self.target, prompt, None if plain else self.drafter, config,
                              on_text=on_text,
                              on_step=step_seen if tuner is not None else on_step,
                              should_stop=should_stop,
                              cost=self.cost, governor=None if plain else self.governor,
                              remember=remember, on_logprobs=on_logprobs)
        finally:
            if self.threads is not None:
                self.threads.after_answer(tuner)
                self.threads.idle()
        if not plain and remember:
            self._save_memory()
        if not plain and self._draft_pair is not None:
            with contextlib.suppress(OSError):  # a read-only disk must not stop the chat
                DraftRecord(self._cache_dir()).add(self._draft_pair, result.stats.steps)
        if not plain:
            self._check_plan(result)
        return result

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
        """One line: model, threads, and what drafts."""
        how = self.plan.layout_text() if self.plan is not None else \
            f"drafter: {self.drafter_name}"
        if self.workers and self.plan is None:  # a plan's layout names them already
            how += "; target on " + ", ".join(w.endpoint for w in self.workers)
        return f"{self.model.path.name} ({self.n_threads} threads; {how})"

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
