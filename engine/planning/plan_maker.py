"""What ``auto`` plans with, for one engine: the drafters it may choose from, this
machine's measured costs (cached, or measured now), the plan they price, the plan's log
and its check against the answers, and measuring again.

``engine.session.Engine`` asks it for the plan at start and after every answer; the
engine applies plans (``Engine.apply_plan``), this module only makes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from engine.decoding.budget import MAX_MEMORY_DRAFT
from engine.decoding.stats import StepStats
from engine.drafters.head_fit import NO_TORCH, check_head_fits, torch_available
from engine.drafters.kinds import DrafterKind
from engine.drafters.spec import DrafterSpec
from engine.errors import TandemError
from engine.gguf.draft_compat import check_draft_model
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
from engine.planning.kernels import choose_kernels
from engine.planning.machine_load import look_at_load
from engine.planning.plan_check import PlanChange, PlanCheck
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
from engine.runtime.hardware import HardwareProfile
from engine.runtime.memory_fit import fits_gpu, target_need
from engine.runtime.model_info import ModelInfo, read_model_info, read_vocab_facts
from engine.runtime.target import Target, TargetConfig

log = logging.getLogger(__name__)
Say = Callable[[str], None]


@dataclass(frozen=True)
class Setup:
    """What the engine runs: the target's GPU layers, the drafter and its budget, and the
    plan they come from (None for a drafter asked by name, or plain decoding)."""

    gpu_layers: int
    spec: DrafterSpec
    max_draft: int
    plan: Plan | None = None

    @classmethod
    def plain(cls) -> Setup:
        return cls(0, DrafterSpec(DrafterKind.NONE), 0)


@dataclass(frozen=True)
class DraftOptions:
    """The drafters auto may choose besides memory, each where it fits this model."""

    head_dir: Path | None = None
    draft_model: Path | None = None
    mtp: MtpFacts | None = None
    eagle3: tuple[Path, Eagle3Facts] | None = None


class PlanMaker:
    """Plans for one model on this machine (see the module docstring)."""

    def __init__(self, model: ModelInfo, hardware: HardwareProfile, n_threads: int,
                 overrides: Overrides, cache_dir: Path, notes: list[str]) -> None:
        self.model, self.hardware, self.n_threads = model, hardware, n_threads
        self.overrides, self.cache_dir = overrides, cache_dir
        self.notes = notes  # the engine's: what the user is told
        self.options = DraftOptions()
        self.costs: CostProfile | None = None
        self.calibrated_now = False
        self.remeasure_wanted = False  # provisional costs, or a plan changed by answers
        self.cache_key = ""
        self.start_why = ""
        self.check: PlanCheck | None = None  # set by ``watch``
        self.events: list[PlanEvent] = []  # this model's plan changes, oldest first
        self._price: Callable[[CostProfile], Plan] | None = None
        # The GPU probe's verdict for this model (None: not probed), for what the engine
        # verifies where the plan puts the target (engine.planning.prediction_budget).
        self.gpu_exact: bool | None = None

    # --- what auto may choose ----------------------------------------------------------
    def gather_options(self, head_dir: Path | None, draft_model: Path | None,
                       target_config: TargetConfig) -> None:
        self.options = DraftOptions(self._usable_head(head_dir),
                                    self._usable_draft_model(draft_model),
                                    self._usable_mtp(),
                                    self._usable_eagle3(head_dir, target_config))

    def _usable_head(self, asked: Path | None) -> Path | None:
        """The head directory when it fits the model, else None with a note (silent for
        the bundled head, which simply is not for other models)."""
        spec = DrafterSpec(DrafterKind.HEAD, asked)
        if not torch_available():
            if asked is not None:
                self.notes.append(f"the draft head in {asked} is left out: {NO_TORCH}")
            return None
        try:
            if asked is None:
                check_head_fits(spec.head_path, self.model.fingerprint)
            else:  # a head named by the user: its weights must load too, or it is said
                from engine.drafters.head import load_head_drafter

                load_head_drafter(spec.head_path, self.model.path, self.model.fingerprint)
        except (FileNotFoundError, TandemError, ValueError) as exc:
            if asked is not None:
                self.notes.append(f"{exc}; the planner leaves it out")
            return None
        return spec.head_path

    def _usable_draft_model(self, path: Path | None) -> Path | None:
        """The draft model named with auto when llama.cpp's rules let it draft for this
        model, else None with a note naming the fields that differ."""
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
        acceptance, source = DraftRecord(self.cache_dir).acceptance(
            mtp_key(self.model.path), MTP_ACCEPTANCE, "the prior for a model's MTP block")
        return MtpFacts(acceptance, source)

    def _usable_eagle3(self, head_dir: Path | None, target_config: TargetConfig
                       ) -> tuple[Path, Eagle3Facts] | None:
        """An EAGLE-3 head GGUF for this model (imported or bundled) with its acceptance:
        this pair's record, else what the head ships, else the prior."""
        if head_dir is not None or target_config.workers:
            return None  # a torch head asked for; or workers hold the target's LM head
        path = usable_eagle3_head(self.model)
        if path is None:
            return None
        prior, prior_is = EAGLE3_ACCEPTANCE, "the prior for an EAGLE-3 head"
        shipped = shipped_acceptance(path)
        if shipped is not None:
            prior, prior_is = shipped
        acceptance, source = DraftRecord(self.cache_dir).acceptance(
            pair_key(self.model.path, path), prior, prior_is)
        return path, Eagle3Facts(path.name, acceptance, source)

    def _draft_facts(self, path: Path, n_ctx: int) -> DraftModelFacts:
        """Size, KV cache and acceptance (prior, corrected by this pair's record)."""
        info = read_model_info(path)
        acceptance, source = DraftRecord(self.cache_dir).acceptance(
            pair_key(self.model.path, path), DRAFT_MODEL_ACCEPTANCE)
        return DraftModelFacts(path.name, info.size_bytes, info.kv_bytes(n_ctx, "f16", "f16"),
                               acceptance, source)

    # --- the plan at start ---------------------------------------------------------------
    def plan_at_start(self, target_config: TargetConfig, recalibrate: bool, say: Say
                      ) -> tuple[Plan, Target | None]:
        """Costs from the cache or measured now, then the plan. Returns it with the target
        opened for measuring (on the CPU), for reuse when the plan keeps it there.
        Provisional costs (measured on a busy machine) are measured again when the
        machine is quiet now; while it is not, they are used and the engine wants to
        measure again."""
        hw, model, options = self.hardware, self.model, self.options
        placements = ("cpu", "gpu") if self.gpu_can_hold_target(target_config) else ("cpu",)
        if target_config.workers:  # measured through them, where the plan keeps it
            placements = ("workers=" + ",".join(target_config.workers)
                          + f":{target_config.worker_layers}:{target_config.output_here}",)
        head_devices = ("cpu", *(g.device for g in hw.gpus)) if options.head_dir else ()
        cache = CalibrationCache(self.cache_dir)
        self.cache_key = key = cache_key(
            hw.fingerprint(), model.path, options.head_dir, self.n_threads, placements,
            head_devices, options.draft_model, mtp=options.mtp is not None,
            eagle3=options.eagle3[0] if options.eagle3 else None,
            kernels=_kernels_tag(target_config))
        costs = None if recalibrate else cache.get(key)
        self.start_why = ("costs measured again, as asked" if recalibrate else
                          "costs measured for the first time")
        previous = None
        if costs is not None and costs.provisional:
            now = look_at_load(self.n_threads)
            if now.busy:
                self.start_why = (f"costs from a busy machine, kept while it is still "
                                  f"{now.describe()}")
            else:
                say("measuring again: the last measurement was taken on a busy machine")
                previous, costs = costs, None
                self.start_why = "costs measured again on a quiet machine"
        elif costs is not None:
            self.start_why = "planned from the measured costs"
        target = None
        if costs is None:
            self.calibrated_now = True
            target = Target(model.path, target_config)
            costs = self.measure(target, target_config, say)
            if previous is not None and costs.provisional and (
                    previous.others_cores <= costs.others_cores):
                costs = previous  # busy again: the less disturbed measurement stays
            cache.put(key, costs)
        self.costs = costs
        self.remeasure_wanted = costs.provisional
        self._price = self._pricer(target_config, placements, say)
        return self._price(costs), target

    def _pricer(self, target_config: TargetConfig, placements: tuple[str, ...], say: Say
                ) -> Callable[[CostProfile], Plan]:
        """The planner on given costs, with this model's facts and drafts."""
        hw, model, options = self.hardware, self.model, self.options
        head = None
        if options.head_dir is not None:
            matrices = 2 * model.n_vocab * model.n_embd * 4  # embeddings + LM head, float32
            head = HeadFacts.from_dir(options.head_dir, matrices)
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
        draft = options.draft_model
        draft_facts = self._draft_facts(draft, target_config.n_ctx) if draft else None
        overrides = self.overrides
        workers = ",".join(target_config.workers)
        eagle3 = options.eagle3[1] if options.eagle3 else None

        def price(c: CostProfile) -> Plan:
            plan = choose_plan(hw, c, facts, head, overrides, draft_facts, options.mtp, eagle3)
            return replace(plan, target_workers=workers) if workers else plan

        return price

    def price(self, costs: CostProfile) -> Plan:
        """The plan these costs give (after ``plan_at_start``)."""
        assert self._price is not None, "plan_at_start comes first"
        return self._price(costs)

    def watch(self, plan: Plan, device: str) -> None:
        """Check ``plan`` against the answers from now on, unless the user fixed the
        layout or drafter (then the answers do not second-guess it)."""
        if self.costs is not None and self.overrides.layout is None \
                and self.overrides.drafter is None:
            self.check = PlanCheck(self.costs, plan, self.price, device)

    def check_answer(self, target: Target, tokens: list[int], steps: list[StepStats]
                     ) -> PlanChange | None:
        """What an answer's ``steps`` (its prompt and answer ``tokens``) say about the
        plan: a change to make, or None (also when nothing checks the plan). Where the
        answer disagrees, verification is spot-checked on ``target`` at its context."""
        check = self.check
        if check is None:
            return None

        def spot() -> dict[int, float]:
            # The answer's last token is not cached yet: it is the root of the checks.
            if not tokens or target.n_ctx - target.n_used <= max(SPOT_SIZES) + 1:
                return {}
            return spot_check(target, tokens[-1], tokens[-max(SPOT_SIZES):])

        return check.observe(steps, spot)

    # --- measuring -----------------------------------------------------------------------
    def measure(self, target: Target, target_config: TargetConfig, say: Say) -> CostProfile:
        """Everything the planner prices, measured now with ``target`` (on the CPU), and
        the target on the GPU where it fits."""
        hw, options = self.hardware, self.options
        then: list[tuple[str, Callable[[CostProfile], None]]] = []
        if self.gpu_can_hold_target(target_config):
            then.append(("target verification cost on the GPU",
                         lambda costs: self._measure_gpu_target(costs, target_config)))
        return calibrate(target, options.head_dir, ["cpu"] + [g.device for g in hw.gpus],
                         progress=say, fingerprint=self.model.fingerprint,
                         draft_model=options.draft_model,
                         draft_on_gpu=bool(hw.best_gpu and hw.llama_gpu_offload),
                         mtp=options.mtp is not None,
                         eagle3=options.eagle3[0] if options.eagle3 else None, then=then)

    def keep_measured(self, costs: CostProfile, plan_in_use: Plan) -> Plan:
        """Costs measured again on a quiet machine replace the cached ones; returns the
        plan they give (the check compares with them from now on)."""
        CalibrationCache(self.cache_dir).put(self.cache_key, costs)
        self.costs, self.remeasure_wanted = costs, False
        plan = self.price(costs)
        if self.check is not None:
            self.check.rebase(costs, plan)
        return plan

    def _exact_on_gpu(self, target_config: TargetConfig, say: Say,
                      n_gpu_layers: int = -1) -> bool:
        """Whether verified batches equal one-token decoding with the target on the GPU
        (cached per file like the CPU's verdict); where not, drafts stay verified on the
        CPU and a GPU-resident target decodes plainly."""
        try:
            choice = choose_kernels(self.model.path, target_config, self.n_threads,
                                    CalibrationCache(self.cache_dir), say,
                                    n_gpu_layers=n_gpu_layers)
        except TandemError as exc:
            self.notes.append(f"the target was not probed on the GPU ({exc}): drafts are "
                              "verified on the CPU")
            self.gpu_exact = False
            return False
        if not choice.exact:
            self.notes.append("drafts are verified on the CPU: with the target on the GPU a "
                              f"verified batch differs from one-token decoding "
                              f"({choice.probe.describe()})")
        self.gpu_exact = choice.exact
        return choice.exact

    def gpu_can_hold_target(self, target_config: TargetConfig) -> bool:
        if target_config.workers:
            return False
        gpu = self.hardware.best_gpu
        kv = self.model.kv_bytes(target_config.n_ctx, target_config.type_k,
                                 target_config.type_v)
        return bool(gpu and self.hardware.llama_gpu_offload and
                    fits_gpu(target_need(self.model.size_bytes, kv), gpu.free_bytes))

    def _measure_gpu_target(self, costs: CostProfile, target_config: TargetConfig) -> None:
        """The verification curve with every layer on the GPU, as the plan would run it."""
        try:
            with Target(self.model.path, replace(target_config, n_gpu_layers=-1)) as target:
                costs.verify_s["gpu"] = measure_verify_curve(target, costs.context)
        except TandemError as exc:
            self.notes.append(f"the GPU could not take the model to measure it ({exc})")

    # --- from a plan to what runs --------------------------------------------------------
    def setup_for(self, plan: Plan, max_draft_asked: int | None) -> Setup:
        """The drafter, budget and target placement ``plan`` runs."""
        spec = self._spec(plan)
        max_draft = plan.budget.max_draft
        if spec.kind is DrafterKind.HEAD_MEMORY and max_draft_asked is None:
            # A memory match may run long: the per-step budget trims what the head's
            # depth would cut off.
            max_draft = max(max_draft, MAX_MEMORY_DRAFT)
        return Setup(plan.target_gpu_layers, spec, max_draft, plan)

    def _spec(self, plan: Plan) -> DrafterSpec:
        options, kind = self.options, plan.drafter
        head_dir, draft = options.head_dir, options.draft_model
        if kind is DrafterKind.DRAFT and draft is not None:
            return DrafterSpec(kind, head_options={
                "depth": plan.budget.depth,
                "n_gpu_layers": 0 if plan.head_device == "cpu" else -1,
                "draft_ahead": plan.layout == "duodecoding"}, draft_model=draft)
        if kind is DrafterKind.MTP:
            return DrafterSpec(kind, head_options={"depth": plan.budget.depth})
        if kind is DrafterKind.EAGLE3 and options.eagle3 is not None:
            return DrafterSpec(kind, options.eagle3[0],
                               head_options={"depth": plan.budget.depth})
        if kind is DrafterKind.HEAD and head_dir is not None:
            budget = plan.budget
            overlap = plan.layout == "duodecoding"
            return DrafterSpec(plan.runs, head_dir, plan.head_device,
                               {"mode": budget.mode, "depth": budget.depth,
                                "top_k": budget.top_k,
                                "draft_ahead": overlap})
        # Drafts from memory: the plan's, or where what its drafter needs is missing.
        return DrafterSpec(DrafterKind.MEMORY if kind.drafts else DrafterKind.NONE)

    # --- the log and the status ----------------------------------------------------------
    def log_plan(self, plan: Plan, why: str) -> None:
        """Keep the plan in this model's log when it differs from the last one logged."""
        log_file = PlanLog(self.cache_dir)
        self.events = log_file.events(self.cache_key)
        text = plan.layout_text()
        if not self.events or self.events[-1].plan != text:
            self.events.append(log_file.record(self.cache_key, text, why))

    def status(self) -> dict[str, object] | None:
        """When and how the plan's costs were measured, whether they are provisional, the
        last plan change and why, and what the last answer said about the plan."""
        if self.costs is None:
            return None
        last = self.events[-1] if self.events else None
        check = self.check
        return {"costs": self.costs.conditions(), "measured_at": self.costs.measured_at,
                "busy": self.costs.busy, "others_cores": self.costs.others_cores,
                "spread": self.costs.spread, "provisional": self.costs.provisional,
                "remeasure_wanted": self.remeasure_wanted,
                "last_change": last.describe() if last else None,
                "changes": len(check.changes) if check else 0,
                "check": check.last_verdict if check else ""}


def _kernels_tag(config: TargetConfig) -> str | None:
    """The kernels' part of the calibration key: None for the default (repacked weights,
    any batch), so those keys stay as they were."""
    if config.repack and config.max_batch is None:
        return None
    return f"repack={config.repack},max_batch={config.max_batch}"
