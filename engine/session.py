"""The engine: one object that owns the target, the drafter, the cost model, the
governor and the plan, built once in a fixed order.

1. probe the hardware;
2. read the model's facts from its GGUF header (no weights loaded), and choose the CPU
   kernels that make verified batches exact (engine.planning.kernels: probed once per
   model file, cached);
3. (``auto``) calibrate if the cache has no costs for this machine, model, head,
   threads and target placements, measuring the target where plans may put it; plan;
4. open the target once, where the plan puts it (the CPU, with a note, if the GPU
   refuses);
5. build the drafter with one fallback policy (``engine.drafters.open_drafter``).

The CLI, the bench and the GUI's worker construct an ``Engine`` and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from engine.decoding.budget import (
    MAX_DRAFT,
    MAX_DRAFT_LIMIT,
    MAX_MEMORY_DRAFT,
    SpeculationGovernor,
    VerifyCostModel,
)
from engine.decoding.generation import GenerationConfig, GenerationResult, generate
from engine.decoding.stats import StepStats
from engine.drafters import DRAFTER_NAMES, DrafterSpec, open_drafter
from engine.drafters.base import Drafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.eagle3 import Eagle3Drafter
from engine.drafters.head import check_head_fits, load_head_drafter
from engine.drafters.memory import MemoryDrafter
from engine.drafters.merged import MergedDrafter
from engine.drafters.mtp import MtpDrafter
from engine.drafters.suffix_index import SuffixIndex, open_memory
from engine.errors import InvalidSettingError, ModelLoadError, TandemError, WorkerError
from engine.gguf.draft_compat import check_draft_model
from engine.hub.model_store import data_dir, default_model_path, default_model_ready
from engine.planning.calibration import (
    SPOT_SIZES,
    CalibrationCache,
    CostProfile,
    cache_key,
    calibrate,
    measure_verify_curve,
    spot_check,
)
from engine.planning.draft_record import DraftRecord, mtp_key, pair_key
from engine.planning.drafter_options import mtp_option, shipped_acceptance, usable_eagle3_head
from engine.planning.kernels import KernelChoice, choose_kernels
from engine.planning.machine_load import count_as_own, look_at_load
from engine.planning.plan_check import PlanChange, PlanCheck, same_choice
from engine.planning.plan_log import PlanEvent, PlanLog
from engine.planning.planner import (
    DRAFT_MODEL_ACCEPTANCE,
    EAGLE3_ACCEPTANCE,
    MTP_ACCEPTANCE,
    DraftModelFacts,
    Eagle3Facts,
    HeadFacts,
    MtpFacts,
    Overrides,
    Plan,
    choose_plan,
)
from engine.runtime.architecture import RS_ROLLBACK_TOKENS
from engine.runtime.chat_template import OWN_TEMPLATE
from engine.runtime.context_fit import DEFAULT_POLICY, FittedPrompt, fit_messages
from engine.runtime.hardware import HardwareProfile, check_device, default_threads, probe_hardware
from engine.runtime.kv_cache import KV_MODES, KV_TRADE_OFF
from engine.runtime.model_info import ModelInfo, read_model_info, read_vocab_facts
from engine.runtime.native import prompt_kernels_available
from engine.runtime.target import Target, TargetConfig
from engine.workers.endpoints import listener_pid, parse_endpoint
from engine.workers.handshake import WorkerInfo, probe_worker

log = logging.getLogger(__name__)

ENGINE_DRAFTERS = ("auto", *DRAFTER_NAMES)
# Room for a chat prompt and an answer, and for the largest verification batch.
MIN_CTX = 64
DEFAULT_CTX = 4096
GPU_FIT_MARGIN = 1.1  # weights + KV must fit the free VRAM with this margin


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
        self.plan: Plan | None = None
        self.costs: CostProfile | None = None
        self.calibrated_now = False
        self.memory: SuffixIndex | None = None
        self._memory_path: Path | None = None
        # What auto planned with, kept to check the plan against the answers and to
        # measure again (engine.planning.plan_check).
        self.plan_check: PlanCheck | None = None
        self.plan_events: list[PlanEvent] = []  # this model's plan changes, oldest first
        self.remeasure_wanted = False  # provisional costs, or a plan changed by answers
        self._head_dir: Path | None = None
        self._draft_path: Path | None = None
        self._mtp: MtpFacts | None = None
        self._eagle3: tuple[Path, Eagle3Facts] | None = None  # a head auto may price
        self._cache_key = ""
        self._start_why = ""
        path = config.model_path
        if path is None:
            if not default_model_ready():
                say("preparing the bundled model (first start only)")
            path = default_model_path()
        self.hardware = hardware or probe_hardware()
        self.model: ModelInfo = read_model_info(path)
        self.n_threads = config.n_threads or default_threads()
        type_k, type_v = KV_MODES[config.kv_cache]
        target_config = TargetConfig(n_ctx=self._context_length(), n_threads=self.n_threads,
                                     type_k=type_k, type_v=type_v,
                                     # No drafts to take back: no state snapshots to pay.
                                     state_snapshots=config.drafter != "none")
        # Asked before llama.cpp connects: it aborts the process on a failed handshake.
        self.workers: tuple[WorkerInfo, ...] = tuple(probe_worker(w) for w in config.workers)
        for endpoint in config.workers:  # a worker on these cores computes for us
            pid = listener_pid(endpoint)
            if pid is not None:
                count_as_own(pid)
        if self.workers:
            target_config = replace(target_config, workers=config.workers,
                                    worker_layers=self._worker_layers(target_config),
                                    # An EAGLE-3 head uses the target's LM head.
                                    output_here=config.drafter == "eagle3")
            self.notes.append(self._placement_text(target_config))
        # Plain decoding runs on the kernels speculation would use, so an answer does not
        # depend on the drafter: exact kernels cost one-token decoding nothing (same-
        # process A/B on Q4_K_M at a 1B shape: 33.6 ms against 33.2 repacked), only
        # batches (prefill, verification) are up to ~20% slower on the K-quants.
        self.kernels: KernelChoice | None = None
        if self.model.why_plain is None:
            self.kernels = choose_kernels(path, target_config, self.n_threads,
                                          CalibrationCache(self._cache_dir()), say)
            target_config = replace(target_config, repack=self.kernels.repack,
                                    max_batch=self.kernels.max_batch)
        target: Target | None = None
        try:
            if self.model.why_plain is not None:  # known before any probe or measurement
                target = self._open_target(target_config, 0, None)
                spec, self.max_draft = DrafterSpec("none"), 0
                if config.drafter != "none":
                    self.notes.append(f"{path.name} decodes plainly: {self.model.why_plain}")
            elif config.drafter == "auto" and self.kernels is not None and not self.kernels.exact:
                target = self._open_target(target_config, 0, None)
                spec = DrafterSpec("none")
                self.max_draft = 0
                self.notes.append(
                    f"auto does not speculate on {path.name}: {self.kernels.describe()}. "
                    "Choose a drafter by name to speculate anyway")
            elif config.drafter == "auto":
                self._head_dir = self._usable_head()
                self._draft_path = self._usable_draft_model()
                self._mtp = self._usable_mtp()
                self._eagle3 = self._usable_eagle3(target_config)
                target = self._calibrate_and_plan(target_config, say)
                assert self.plan is not None
                target = self._open_target(target_config, self.plan.target_gpu_layers, target)
                spec = self._planned_spec()
                self.max_draft = self._planned_max_draft(spec)
            else:
                target = self._open_target(target_config, 0, None)
                spec = self._asked_spec()
                ov = config.overrides
                cap = (MAX_MEMORY_DRAFT if config.drafter in ("memory", "head+memory")
                       else MAX_DRAFT)
                self.max_draft = cap if ov.max_draft is None else ov.max_draft
            check_first_forward(target)
            if not prompt_kernels_available():
                self.notes.append("this llama.cpp build lacks Tandem's prompt-kernel switch "
                                  "(packaging/llama-cpp/prompt-kernels.patch, applied by make "
                                  "install): prompts are read with the exact kernels, slower")
            if target.template.completion:
                # origin: "a base model, as its name or tags say base"
                self.notes.append(f"{path.name} is {target.template.origin}: it continues "
                                  "your text rather than answering it")
            elif target.template.origin != OWN_TEMPLATE:
                self.notes.append(f"{path.name} has no chat template: chat format "
                                  f"{target.template.origin}")
            if target.max_draft is not None:  # recurrent state's snapshots, exact kernels
                self.max_draft = min(self.max_draft, target.max_draft)
            self.memory = self._open_memory() if spec.name not in ("none", "lookup") else None
            self.drafter: Drafter | None
            # Before the drafter opens: its contexts may hold the target's.
            target.set_state_snapshots(0 if spec.name == "none" else self.max_draft)
            self.drafter, notes = open_drafter(spec, target, self.model.fingerprint,
                                               self.memory)
            self.notes += notes
        except BaseException:
            if target is not None:
                target.close()
            raise
        self.target = target
        self._target_config = target_config
        self._drafter_changed()
        # The budget starts from the calibrated curve where there is one and learns on.
        curve = self.costs.verify_s.get(self._target_device) \
            if self.costs is not None else None
        self.cost = VerifyCostModel.from_curve(curve) if curve else VerifyCostModel()
        if self.plan is not None and self.costs is not None:
            # A layout or drafter the user fixed is not second-guessed by the answers.
            ov = config.overrides
            if ov.layout is None and ov.drafter is None:
                self.plan_check = PlanCheck(self.costs, self.plan, self._price,
                                            self._target_device)
            self._log_plan(self._start_why)

    # --- building, in order ------------------------------------------------------------
    def _worker_layers(self, target_config: TargetConfig) -> int:
        """Every layer on the workers (-1) where their free memory holds the weights and
        the KV cache, else the share that fits (the first layers stay here): the user
        named workers to use their memory and compute. ``worker_layers`` overrides."""
        if self.config.worker_layers is not None:
            return self.config.worker_layers
        model = self.model
        need = model.size_bytes * GPU_FIT_MARGIN + model.kv_bytes(
            target_config.n_ctx, target_config.type_k, target_config.type_v)
        free = sum(w.free_bytes for w in self.workers)
        if need <= free:
            return -1
        layers = int(model.n_layer * free / need)
        if layers < 1:
            raise WorkerError(", ".join(self.config.workers),
                              f"{free / 2**30:.1f} GiB free, too little for one layer of "
                              f"{model.path.name}")
        return layers

    def _placement_text(self, target_config: TargetConfig) -> str:
        # llama.cpp counts the output layer as the first of the layers it offloads.
        layers, n = target_config.worker_layers, self.model.n_layer
        blocks = (f"all {n} layers" if layers < 0 or layers > n else
                  f"the last {layers - 1} of {n} layers (the rest here)")
        output = ("the output layer here" if target_config.output_here
                  else "the output there")
        rtt = ", ".join(f"{w.endpoint} ({w.round_trip_s * 1e3:.2f} ms round trip)"
                        for w in self.workers)
        return f"the target runs {blocks} on worker {rtt}, {output}; drafts are made here"

    def _context_length(self) -> int:
        """The context asked for, checked against what the model was trained for (more
        would give garbage past it); unasked, DEFAULT_CTX or the trained length if less."""
        trained = self.model.header.context_length
        asked = self.config.n_ctx
        if asked is None:
            return min(DEFAULT_CTX, trained or DEFAULT_CTX)
        if trained and asked > trained:
            raise InvalidSettingError("n_ctx", f"must be at most {trained} tokens (what "
                                      f"{self.model.path.name} was trained for)", asked)
        return asked

    def _usable_head(self) -> Path | None:
        """The head directory when it fits the model, else None with a note (silent for
        the bundled head, which simply is not for other models)."""
        asked = self.config.head_dir
        spec = DrafterSpec("head", asked)
        try:
            if asked is None:
                check_head_fits(spec.head_path, self.model.fingerprint)
            else:  # a head named by the user: its weights must load too, or it is said
                load_head_drafter(spec.head_path, self.model.path, self.model.fingerprint)
        except (FileNotFoundError, TandemError, ValueError) as exc:
            if asked is not None:
                self.notes.append(f"{exc}; the planner leaves it out")
            return None
        return spec.head_path

    def _usable_draft_model(self) -> Path | None:
        """The draft model named with auto when llama.cpp's rules let it draft for this
        model, else None with a note naming the fields that differ."""
        path = self.config.draft_model
        if path is None:
            return None
        try:
            check_draft_model(read_vocab_facts(path), read_vocab_facts(self.model.path))
        except TandemError as exc:
            self.notes.append(f"{exc}; the planner leaves it out")
            return None
        return path

    def _usable_mtp(self) -> MtpFacts | None:
        """The model's own MTP block when it can draft here, with the acceptance this
        model's answers reached (or the prior)."""
        if not mtp_option(self.model.header).available:
            return None
        acceptance, source = DraftRecord(self._cache_dir()).acceptance(
            mtp_key(self.model.path), MTP_ACCEPTANCE, "the prior for a model's MTP block")
        return MtpFacts(acceptance, source)

    def _usable_eagle3(self, target_config: TargetConfig) -> tuple[Path, Eagle3Facts] | None:
        """An EAGLE-3 head GGUF for this model (imported or bundled) with its acceptance:
        this pair's record, else what the head ships, else the prior."""
        if self.config.head_dir is not None or target_config.workers:
            return None  # a torch head asked for; or workers hold the target's LM head
        path = usable_eagle3_head(self.model)
        if path is None:
            return None
        prior, prior_is = EAGLE3_ACCEPTANCE, "the prior for an EAGLE-3 head"
        shipped = shipped_acceptance(path)
        if shipped is not None:
            prior, prior_is = shipped
        acceptance, source = DraftRecord(self._cache_dir()).acceptance(
            pair_key(self.model.path, path), prior, prior_is)
        return path, Eagle3Facts(path.name, acceptance, source)

    def _cache_dir(self) -> Path:
        return Path(self.config.cache_dir or data_dir() / "cache")

    def _draft_facts(self, path: Path, n_ctx: int) -> DraftModelFacts:
        """Size, KV cache and acceptance (prior, corrected by this pair's record)."""
        info = read_model_info(path)
        acceptance, source = DraftRecord(self._cache_dir()).acceptance(
            pair_key(self.model.path, path), DRAFT_MODEL_ACCEPTANCE)
        return DraftModelFacts(path.name, info.size_bytes, info.kv_bytes(n_ctx, "f16", "f16"),
                               acceptance, source)

    def _calibrate_and_plan(self, target_config: TargetConfig, say: Callable[[str], None]
                            ) -> Target | None:
        """Costs from the cache or measured now, then the plan. Returns the target opened
        for measuring (on the CPU), for reuse when the plan keeps it there. Provisional
        costs (measured on a busy machine) are measured again when the machine is quiet
        now; while it is not, they are used and the engine wants to measure again."""
        hw, model = self.hardware, self.model
        head_dir, draft = self._head_dir, self._draft_path
        placements = ("cpu", "gpu") if self._gpu_can_hold_target(target_config) else ("cpu",)
        if target_config.workers:  # measured through them, where the plan keeps it
            placements = ("workers=" + ",".join(target_config.workers)
                          + f":{target_config.worker_layers}:{target_config.output_here}",)
        head_devices = ("cpu", *(g.device for g in hw.gpus)) if head_dir else ()
        cache = CalibrationCache(self._cache_dir())
        self._cache_key = key = cache_key(hw.fingerprint(), model.path, head_dir,
                                          self.n_threads, placements, head_devices, draft,
                                          mtp=self._mtp is not None,
                                          eagle3=self._eagle3[0] if self._eagle3 else None,
                                          kernels=_kernels_tag(target_config))
        costs = None if self.config.recalibrate else cache.get(key)
        self._start_why = ("costs measured again, as asked" if self.config.recalibrate else
                           "costs measured for the first time")
        previous = None
        if costs is not None and costs.provisional:
            now = look_at_load(self.n_threads)
            if now.busy:
                self._start_why = (f"costs from a busy machine, kept while it is still "
                                   f"{now.describe()}")
            else:
                say("measuring again: the last measurement was taken on a busy machine")
                previous, costs = costs, None
                self._start_why = "costs measured again on a quiet machine"
        elif costs is not None:
            self._start_why = "planned from the measured costs"
        target = None
        if costs is None:
            self.calibrated_now = True
            target = Target(model.path, target_config)
            costs = self._measure(target, target_config, say)
            if previous is not None and costs.provisional and (
                    previous.others_cores <= costs.others_cores):
                costs = previous  # busy again: the less disturbed measurement stays
            cache.put(key, costs)
        self.costs = costs
        self.remeasure_wanted = costs.provisional
        head = None
        if head_dir is not None:
            matrices = 2 * model.n_vocab * model.n_embd * 4  # embeddings + LM head, float32
            head = HeadFacts.from_dir(head_dir, matrices)
        facts = model.planner_facts(target_config.n_ctx, target_config.type_k,
                                    target_config.type_v)
        if target_config.max_batch is not None:  # the exact kernels' longest verification
            cap = target_config.max_batch - 1
            facts = replace(facts, max_draft=min(cap, facts.max_draft if facts.max_draft
                                                 is not None else cap))
        if hw.best_gpu and hw.llama_gpu_offload:
            # Probed as the plan could place it: whole, or (Dovetail beside a head on a
            # small GPU) some layers; one layer there already runs on the GPU's kernels.
            layers = -1 if "gpu" in placements else 1
            facts = replace(facts, exact_on_gpu=self._exact_on_gpu(target_config, say, layers))
        draft_facts = self._draft_facts(draft, target_config.n_ctx) if draft else None
        overrides = self.config.overrides
        workers = ",".join(target_config.workers)
        eagle3 = self._eagle3[1] if self._eagle3 else None

        def price(c: CostProfile) -> Plan:
            plan = choose_plan(hw, c, facts, head, overrides, draft_facts, self._mtp, eagle3)
            return replace(plan, target_workers=workers) if workers else plan

        self._price = price
        self.plan = price(costs)
        return target

    def _measure(self, target: Target, target_config: TargetConfig,
                 say: Callable[[str], None]) -> CostProfile:
        """Everything the planner prices, measured now with ``target`` (on the CPU), and
        the target on the GPU where it fits."""
        hw = self.hardware
        costs = calibrate(target, self._head_dir, ["cpu"] + [g.device for g in hw.gpus],
                          progress=say, fingerprint=self.model.fingerprint,
                          draft_model=self._draft_path,
                          draft_on_gpu=bool(hw.best_gpu and hw.llama_gpu_offload),
                          mtp=self._mtp is not None,
                          eagle3=self._eagle3[0] if self._eagle3 else None)
        if self._gpu_can_hold_target(target_config):
            self._measure_gpu_target(costs, target_config, say)
        return costs

    def _exact_on_gpu(self, target_config: TargetConfig, say: Callable[[str], None],
                      n_gpu_layers: int = -1) -> bool:
        """Whether verified batches equal one-token decoding with the target on the GPU
        (cached per file like the CPU's verdict); where not, drafts stay verified on the
        CPU and a GPU-resident target decodes plainly."""
        try:
            choice = choose_kernels(self.model.path, target_config, self.n_threads,
                                    CalibrationCache(self._cache_dir()), say,
                                    n_gpu_layers=n_gpu_layers)
        except TandemError as exc:
            self.notes.append(f"the target was not probed on the GPU ({exc}): drafts are "
                              "verified on the CPU")
            return False
        if not choice.exact:
            self.notes.append("drafts are verified on the CPU: with the target on the GPU a "
                              f"verified batch differs from one-token decoding "
                              f"({choice.probe.describe()})")
        return choice.exact

    def _gpu_can_hold_target(self, target_config: TargetConfig) -> bool:
        if target_config.workers:
            return False
        gpu = self.hardware.best_gpu
        need = self.model.size_bytes * GPU_FIT_MARGIN + self.model.kv_bytes(
            target_config.n_ctx, target_config.type_k, target_config.type_v)
        return bool(gpu and self.hardware.llama_gpu_offload and need < gpu.free_bytes)

    def _measure_gpu_target(self, costs: CostProfile, target_config: TargetConfig,
                            say: Callable[[str], None]) -> None:
        """The verification curve with every layer on the GPU, as the plan would run it."""
        say("target verification cost on the GPU")
        try:
            with Target(self.model.path, replace(target_config, n_gpu_layers=-1)) as target:
                costs.verify_s["gpu"] = measure_verify_curve(target, costs.context)
        except TandemError as exc:
            self.notes.append(f"the GPU could not take the model to measure it ({exc})")

    def _open_target(self, target_config: TargetConfig, gpu_layers: int,
                     opened: Target | None) -> Target:
        """The target with ``gpu_layers`` offloaded: ``opened`` when it already is, else
        a new one (and the CPU with a note when the GPU refuses)."""
        if opened is not None and opened.n_gpu_layers == gpu_layers:
            return opened
        if opened is not None:
            opened.close()
        try:
            return Target(self.model.path, replace(target_config, n_gpu_layers=gpu_layers))
        except TandemError as exc:
            if gpu_layers == 0:
                raise
            self.notes.append(f"the GPU could not take the model ({exc}); it runs on the CPU")
            return Target(self.model.path, target_config)

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

    def _planned_spec(self) -> DrafterSpec:
        plan, head_dir, draft = self.plan, self._head_dir, self._draft_path
        assert plan is not None
        if plan.drafter == "draft" and draft is not None:
            return DrafterSpec("draft", head_options={
                "depth": plan.budget.depth,
                "n_gpu_layers": 0 if plan.head_device == "cpu" else -1,
                "draft_ahead": plan.layout == "duodecoding"}, draft_model=draft)
        if plan.drafter == "mtp":
            return DrafterSpec("mtp", head_options={"depth": plan.budget.depth})
        if plan.drafter == "eagle3" and self._eagle3 is not None:
            return DrafterSpec("eagle3", self._eagle3[0],
                               head_options={"depth": plan.budget.depth})
        if plan.drafter == "head" and head_dir is not None:
            budget = plan.budget
            overlap = plan.layout == "duodecoding"
            return DrafterSpec(plan.runs, head_dir, plan.head_device,
                               {"mode": budget.mode, "depth": budget.depth,
                                "top_k": budget.top_k,
                                "draft_ahead": overlap})
        return DrafterSpec("memory" if plan.drafter != "none" else "none")

    def _planned_max_draft(self, spec: DrafterSpec) -> int:
        assert self.plan is not None
        max_draft = self.plan.budget.max_draft
        if spec.name == "head+memory" and self.config.overrides.max_draft is None:
            # A memory match may run long: the per-step budget trims what the head's
            # depth would cut off.
            max_draft = max(max_draft, MAX_MEMORY_DRAFT)
        return max_draft

    def _drafter_changed(self) -> None:
        """The pair record and the governor for the drafter now in use."""
        config = self.config
        # A draft model's steps correct the acceptance the next plan assumes for the pair.
        self._draft_pair = (pair_key(self.model.path, config.draft_model)
                            if isinstance(self.drafter, DraftModelDrafter)
                            and config.draft_model is not None else
                            mtp_key(self.model.path) if isinstance(self.drafter, MtpDrafter)
                            else pair_key(self.model.path, self.drafter.path)
                            if isinstance(self.drafter, Eagle3Drafter) else None)
        # With auto every drafter is governed: a head or draft model whose drafts cost
        # time and are not accepted is paused and probed again. Drafts from memory cost
        # microseconds and their hits come in bursts: they are let off 5% of a token and
        # paused 32 steps at most, so a repeat is not missed for long. A drafter asked
        # for by name runs as asked.
        self.governor = None
        if config.drafter == "auto" and self.drafter is not None:
            self.governor = (SpeculationGovernor() if self.drafter.is_draft_model else
                             SpeculationGovernor(tolerance=0.05, max_pause=32))

    def _asked_spec(self) -> DrafterSpec:
        config = self.config
        options: dict[str, object] = {}
        if config.overrides.depth:
            options["depth"] = config.overrides.depth
        head_dir = config.head_dir
        if config.drafter == "eagle3" and head_dir is None:
            # An imported head that fits this model, else the bundled model's.
            head_dir = usable_eagle3_head(self.model)
        return DrafterSpec(config.drafter, head_dir, config.head_device, options,
                           config.draft_model)

    # --- plans that stay right ----------------------------------------------------------
    @property
    def _target_device(self) -> str:
        target = getattr(self, "target", None)
        return "gpu" if target is not None and target.n_gpu_layers else "cpu"

    def _log_plan(self, why: str) -> None:
        """Keep the plan in this model's log when it differs from the last one logged."""
        assert self.plan is not None
        log_file = PlanLog(self._cache_dir())
        self.plan_events = log_file.events(self._cache_key)
        text = self.plan.layout_text()
        if not self.plan_events or self.plan_events[-1].plan != text:
            self.plan_events.append(log_file.record(self._cache_key, text, why))

    def _switch_plan(self, plan: Plan, why: str) -> None:
        """Run ``plan`` from the next answer on: the target where it puts it, its drafter
        and budget (between answers: nothing in flight)."""
        self.plan = plan
        self.target = self._open_target(self._target_config, plan.target_gpu_layers,
                                        self.target)
        self._attach_planned_drafter()
        self._log_plan(why)
        log.info("plan changed to %s: %s", plan.layout_text(), why)

    def _detach_drafter(self) -> None:
        old, self.drafter = self.drafter, None
        if old is not None:
            old.close()

    def _attach_planned_drafter(self) -> None:
        """The plan's drafter and budget, in place of the drafter in use."""
        spec = self._planned_spec()
        if spec.name not in ("none", "lookup") and self.memory is None:
            self.memory = self._open_memory()
        self._detach_drafter()
        # A hybrid's recurrent state keeps snapshots for the longest draft that may come,
        # none without drafts: every decode writes each one, so auto drafting nothing, or
        # 2 tokens from memory, would pay for 8. Set before the drafter opens: its
        # contexts may hold the target's.
        self.target.set_state_snapshots(
            0 if spec.name == "none" else self._planned_max_draft(spec))
        self.drafter, notes = open_drafter(spec, self.target, self.model.fingerprint,
                                           self.memory)
        self.notes += notes
        self.max_draft = self._planned_max_draft(spec)
        if self.target.max_draft is not None:
            self.max_draft = min(self.max_draft, self.target.max_draft)
        self._drafter_changed()

    def _check_plan(self, result: GenerationResult) -> None:
        if self.plan_check is None:
            return
        target, tokens = self.target, result.tokens

        def spot() -> dict[int, float]:
            # The answer's last token is not cached yet: it is the root of the checks.
            if not tokens or target.n_ctx - target.n_used <= max(SPOT_SIZES) + 1:
                return {}
            return spot_check(target, tokens[-1], tokens[-max(SPOT_SIZES):])

        change: PlanChange | None = self.plan_check.observe(result.stats.steps, spot)
        if change is not None:
            self._switch_plan(change.new, change.why)
            self.remeasure_wanted = True  # settle it with a real measurement when idle

    def remeasure(self, progress: Callable[[str], None] | None = None) -> bool:
        """Measure this machine's costs again (between answers: the target's cache is
        emptied) and plan from them. A quiet measurement replaces the cached one and the
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
        try:
            costs = self._measure(target, self._target_config, say)
        finally:
            if not on_cpu:
                target.close()
            if refit:  # the plan in use, until a new one replaces it
                self._attach_planned_drafter()
        if costs.provisional:
            return False
        CalibrationCache(self._cache_dir()).put(self._cache_key, costs)
        self.costs, self.remeasure_wanted = costs, False
        plan = self._price(costs)
        changed = not same_choice(plan, self.plan)
        if self.plan_check is not None:
            self.plan_check.rebase(costs, plan)
        if changed:
            self._switch_plan(plan, "costs measured again while the app was idle")
        else:
            self.plan = plan
        return changed

    def plan_status(self) -> dict[str, object] | None:
        """When and how the plan's costs were measured, whether they are provisional, the
        last plan change and why, and what the last answer said about the plan."""
        if self.costs is None or self.plan is None:
            return None
        last = self.plan_events[-1] if self.plan_events else None
        check = self.plan_check
        return {"costs": self.costs.conditions(), "measured_at": self.costs.measured_at,
                "busy": self.costs.busy, "others_cores": self.costs.others_cores,
                "spread": self.costs.spread, "provisional": self.costs.provisional,
                "remeasure_wanted": self.remeasure_wanted,
                "last_change": last.describe() if last else None,
                "changes": len(check.changes) if check else 0,
                "check": check.last_verdict if check else ""}

    # --- use ---------------------------------------------------------------------------
    @property
    def drafter_name(self) -> str:
        """The drafter in use: "head", "lookup" or "none"."""
        return self.drafter.name if self.drafter is not None else "none"

    def chat_prompt(self, messages: list[dict[str, str]],
                    enable_thinking: bool | None = None) -> list[int]:
        return self.target.chat_prompt(messages, enable_thinking=enable_thinking)

    def fit_chat(self, messages: list[dict[str, str]], max_tokens: int,
                 policy: str = DEFAULT_POLICY, enable_thinking: bool | None = None
                 ) -> FittedPrompt:
        """The prompt for a conversation that may outgrow the context: under
        ``drop_oldest`` the system prompt and the newest turns that leave room for the
        answer (engine.runtime.context_fit); under ``stop`` all of it."""
        return fit_messages(lambda m: self.chat_prompt(m, enable_thinking), messages,
                            self.target.n_ctx, max_tokens, policy)

    def generate(self, prompt: list[int], config: GenerationConfig | None = None, *,
                 on_text: Callable[[str], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 plain: bool = False, remember: bool = True) -> GenerationResult:
        """Generate after ``prompt`` (tokens) with the engine's drafter and budget, or
        with none when ``plain``; the cost model learns across generations, and a drafter
        with memory keeps the answer (saved at once) unless ``remember`` is False.
        Raises what ``engine.decoding.generation.generate`` raises."""
        config = replace(config or GenerationConfig(),
                         max_draft=0 if plain else self.max_draft)
        result = generate(self.target, prompt, None if plain else self.drafter, config,
                          on_text=on_text, on_step=on_step, should_stop=should_stop,
                          cost=self.cost, governor=None if plain else self.governor,
                          remember=remember)
        if not plain and remember:
            self._save_memory()
        if not plain and self._draft_pair is not None:
            with contextlib.suppress(OSError):  # a read-only disk must not stop the chat
                DraftRecord(self._cache_dir()).add(self._draft_pair, result.stats.steps)
        if not plain:
            self._check_plan(result)
        return result

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
        drafter, self.drafter = getattr(self, "drafter", None), None
        if drafter is not None:
            drafter.close()
        target = getattr(self, "target", None)
        if target is not None:
            target.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _kernels_tag(config: TargetConfig) -> str | None:
    """The kernels' part of the calibration key: None for the default (repacked weights,
    any batch), so those keys stay as they were."""
    if config.repack and config.max_batch is None:
        return None
    return f"repack={config.repack},max_batch={config.max_batch}"
