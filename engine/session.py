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
from engine.drafters.head import check_head_fits, load_head_drafter
from engine.drafters.memory import MemoryDrafter
from engine.drafters.merged import MergedDrafter
from engine.drafters.suffix_index import SuffixIndex, open_memory
from engine.errors import InvalidSettingError, ModelLoadError, TandemError
from engine.gguf.draft_compat import check_draft_model
from engine.hub.model_store import data_dir, default_model_path, default_model_ready
from engine.planning.calibration import (
    CalibrationCache,
    CostProfile,
    cache_key,
    calibrate,
    measure_verify_curve,
)
from engine.planning.draft_record import DraftRecord, pair_key
from engine.planning.kernels import KernelChoice, choose_kernels
from engine.planning.planner import (
    DRAFT_MODEL_ACCEPTANCE,
    DraftModelFacts,
    HeadFacts,
    Overrides,
    Plan,
    choose_plan,
)
from engine.runtime.chat_template import OWN_TEMPLATE
from engine.runtime.hardware import HardwareProfile, check_device, default_threads, probe_hardware
from engine.runtime.kv_cache import KV_MODES, KV_TRADE_OFF
from engine.runtime.model_info import ModelInfo, read_model_info, read_vocab_facts
from engine.runtime.target import Target, TargetConfig

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
        # Plain decoding is its own reference: only speculation needs the probe.
        self.kernels: KernelChoice | None = None
        if config.drafter != "none" and self.model.why_plain is None:
            self.kernels = choose_kernels(path, target_config, self.n_threads,
                                          CalibrationCache(self._cache_dir()), say)
            target_config = replace(target_config, repack=self.kernels.repack)
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
                head_dir = self._usable_head()
                draft = self._usable_draft_model()
                target = self._calibrate_and_plan(target_config, head_dir, say, draft)
                assert self.plan is not None
                target = self._open_target(target_config, self.plan.target_gpu_layers, target)
                spec = self._planned_spec(head_dir, draft)
                self.max_draft = self.plan.budget.max_draft
                if spec.name == "head+memory" and config.overrides.max_draft is None:
                    # A memory match may run long: the per-step budget trims what the
                    # head's depth would cut off.
                    self.max_draft = max(self.max_draft, MAX_MEMORY_DRAFT)
            else:
                target = self._open_target(target_config, 0, None)
                spec = self._asked_spec()
                ov = config.overrides
                cap = (MAX_MEMORY_DRAFT if config.drafter in ("memory", "head+memory")
                       else MAX_DRAFT)
                self.max_draft = cap if ov.max_draft is None else ov.max_draft
            check_first_forward(target)
            if target.template.completion:
                # origin: "a base model, as its name or tags say base"
                self.notes.append(f"{path.name} is {target.template.origin}: it continues "
                                  "your text rather than answering it")
            elif target.template.origin != OWN_TEMPLATE:
                self.notes.append(f"{path.name} has no chat template: chat format "
                                  f"{target.template.origin}")
            if target.max_draft is not None:  # recurrent state: as far as its snapshots go
                self.max_draft = min(self.max_draft, target.max_draft)
            self.memory = self._open_memory() if spec.name not in ("none", "lookup") else None
            self.drafter: Drafter | None
            self.drafter, notes = open_drafter(spec, target, self.model.fingerprint,
                                               self.memory)
            self.notes += notes
        except BaseException:
            if target is not None:
                target.close()
            raise
        self.target = target
        # A draft model's steps correct the acceptance the next plan assumes for the pair.
        self._draft_pair = (pair_key(self.model.path, config.draft_model)
                            if isinstance(self.drafter, DraftModelDrafter)
                            and config.draft_model is not None else None)
        # The governor guards a draft model, whose every draft costs time. Prompt lookup
        # costs ~nothing when it has no match and its hits come in bursts a pause would
        # miss: the per-step budget is the right judge there. A drafter asked for by
        # name runs as asked.
        self.governor = (SpeculationGovernor() if config.drafter == "auto" and self.drafter
                         is not None and self.drafter.is_draft_model else None)
        # The budget starts from the calibrated curve where there is one and learns on.
        curve = self.costs.verify_s.get("gpu" if target.n_gpu_layers else "cpu") \
            if self.costs is not None else None
        self.cost = VerifyCostModel.from_curve(curve) if curve else VerifyCostModel()

    # --- building, in order ------------------------------------------------------------
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

    def _cache_dir(self) -> Path:
        return Path(self.config.cache_dir or data_dir() / "cache")

    def _draft_facts(self, path: Path, n_ctx: int) -> DraftModelFacts:
        """Size, KV cache and acceptance (prior, corrected by this pair's record)."""
        info = read_model_info(path)
        acceptance, source = DraftRecord(self._cache_dir()).acceptance(
            pair_key(self.model.path, path), DRAFT_MODEL_ACCEPTANCE)
        return DraftModelFacts(path.name, info.size_bytes, info.kv_bytes(n_ctx, "f16", "f16"),
                               acceptance, source)

    def _calibrate_and_plan(self, target_config: TargetConfig, head_dir: Path | None,
                            say: Callable[[str], None], draft: Path | None = None
                            ) -> Target | None:
        """Costs from the cache or measured now, then the plan. Returns the target opened
        for measuring (on the CPU), for reuse when the plan keeps it there."""
        hw, model = self.hardware, self.model
        gpu_target = self._gpu_can_hold_target(target_config)
        placements = ("cpu", "gpu") if gpu_target else ("cpu",)
        head_devices = ["cpu"] + [g.device for g in hw.gpus]
        cache = CalibrationCache(self._cache_dir())
        key = cache_key(hw.fingerprint(), model.path, head_dir, self.n_threads,
                        placements, tuple(head_devices) if head_dir else (), draft)
        costs = None if self.config.recalibrate else cache.get(key)
        target = None
        if costs is None:
            self.calibrated_now = True
            target = Target(model.path, target_config)
            costs = calibrate(target, head_dir, head_devices, progress=say,
                              fingerprint=model.fingerprint, draft_model=draft,
                              draft_on_gpu=bool(hw.best_gpu and hw.llama_gpu_offload))
            if gpu_target:
                self._measure_gpu_target(costs, target_config, say)
            cache.put(key, costs)
        self.costs = costs
        head = None
        if head_dir is not None:
            matrices = 2 * model.n_vocab * model.n_embd * 4  # embeddings + LM head, float32
            head = HeadFacts.from_dir(head_dir, matrices)
        facts = model.planner_facts(target_config.n_ctx, target_config.type_k,
                                    target_config.type_v)
        draft_facts = self._draft_facts(draft, target_config.n_ctx) if draft else None
        self.plan = choose_plan(hw, costs, facts, head, self.config.overrides, draft_facts)
        return target

    def _gpu_can_hold_target(self, target_config: TargetConfig) -> bool:
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

    def _planned_spec(self, head_dir: Path | None, draft: Path | None = None) -> DrafterSpec:
        plan = self.plan
        assert plan is not None
        if plan.drafter == "draft" and draft is not None:
            return DrafterSpec("draft", head_options={
                "depth": plan.budget.depth,
                "n_gpu_layers": 0 if plan.head_device == "cpu" else -1,
                "draft_ahead": plan.layout == "duodecoding"}, draft_model=draft)
        if plan.drafter == "head" and head_dir is not None:
            budget = plan.budget
            overlap = plan.layout == "duodecoding"
            return DrafterSpec(plan.runs, head_dir, plan.head_device,
                               {"mode": budget.mode, "depth": budget.depth,
                                "top_k": budget.top_k,
                                "draft_ahead": overlap})
        return DrafterSpec("memory" if plan.drafter != "none" else "none")

    def _asked_spec(self) -> DrafterSpec:
        config = self.config
        options: dict[str, object] = {}
        if config.overrides.depth:
            options["depth"] = config.overrides.depth
        return DrafterSpec(config.drafter, config.head_dir, config.head_device, options,
                           config.draft_model)

    # --- use ---------------------------------------------------------------------------
    @property
    def drafter_name(self) -> str:
        """The drafter in use: "head", "lookup" or "none"."""
        return self.drafter.name if self.drafter is not None else "none"

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.target.chat_prompt(messages)

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
