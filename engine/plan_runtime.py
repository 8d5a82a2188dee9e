"""From a loaded target to a running plan: probe, calibrate (cached), plan, build.

Every failure on the way falls back and says so in ``notes``: a head that does not fit
the target or cannot load means no head; a GPU that cannot take the head means the head
on the CPU, then prompt lookup.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.budget import SpeculationGovernor
from engine.calibration import CalibrationCache, CostProfile, cache_key, calibrate
from engine.drafters import DEFAULT_HEAD_DIR, make_drafter
from engine.drafters.base import Drafter
from engine.errors import TandemError
from engine.hardware import HardwareProfile, probe_hardware
from engine.model_store import data_dir
from engine.planner import HeadFacts, ModelFacts, Overrides, Plan, choose_plan
from engine.target import Target

log = logging.getLogger(__name__)


@dataclass
class PlannedSetup:
    plan: Plan
    costs: CostProfile
    hardware: HardwareProfile
    head_dir: Path | None  # None: no usable head
    notes: list[str] = field(default_factory=list)
    calibrated_now: bool = False


def usable_head(target: Target, head_dir: Path | None) -> tuple[Path | None, str]:
    """The head directory if its fingerprint fits ``target`` (else None and why)."""
    from models.gguf_weights import fingerprint
    from models.head_config import HeadConfig

    directory = Path(head_dir) if head_dir else DEFAULT_HEAD_DIR
    if not (directory / "head.json").is_file():
        if head_dir is None:
            return None, ""
        return None, f"no draft head in {directory}"
    try:
        cfg = HeadConfig.load(directory / "head.json")
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return None, f"the draft head in {directory} is unreadable ({exc})"
    if cfg.target is not None:
        problems = cfg.target.mismatches(fingerprint(target.model.pieces(), target.n_embd))
        if problems:
            quiet = head_dir is None  # the bundled head simply is not for this model
            return None, "" if quiet else (f"the draft head in {directory} does not fit "
                                           f"this model: {'; '.join(problems)}")
    return directory, ""


def model_facts(target: Target, n_ctx: int | None = None) -> ModelFacts:
    n_ctx = n_ctx or target.n_ctx
    # K in q8_0 (~1.06 bytes/value) and V in f16: per token and layer, n_embd_kv each.
    kv = int(n_ctx * target.model.n_layer * target.n_embd * 0.5 * (1.06 + 2))
    return ModelFacts(target.path.stat().st_size, target.model.n_layer, kv)


def plan_for(target: Target, head_dir: Path | None = None,
             overrides: Overrides | None = None, recalibrate: bool = False,
             cache_dir: Path | None = None, hardware: HardwareProfile | None = None,
             progress: Callable[[str], None] | None = None) -> PlannedSetup:
    """Probe the machine, load or measure the costs, and plan for ``target``."""
    hw = hardware or probe_hardware()
    notes: list[str] = []
    head, why = usable_head(target, head_dir)
    if why:
        notes.append(why)
    cache = CalibrationCache(cache_dir or data_dir() / "cache")
    key = cache_key(hw.fingerprint(), target.path, head, target.n_threads)
    costs = None if recalibrate else cache.get(key)
    calibrated_now = costs is None
    if costs is None:
        devices = ["cpu"] + [("mps" if g.backend == "mps" else f"{g.backend}:{g.index}")
                             for g in hw.gpus]
        costs = calibrate(target, head, devices, progress=progress)
        cache.put(key, costs)
    facts = None
    if head is not None:
        matrices = 2 * target.n_vocab * target.n_embd * 4  # embeddings + LM head, float32
        facts = HeadFacts.from_dir(head, matrices)
    plan = choose_plan(hw, costs, model_facts(target), facts, overrides)
    return PlannedSetup(plan, costs, hw, head, notes, calibrated_now)


def build_drafter(setup: PlannedSetup, target: Target) -> tuple[Drafter | None, list[str]]:
    """The plan's drafter, falling back (GPU -> CPU head -> prompt lookup) with notes."""
    plan = setup.plan
    notes: list[str] = []
    if plan.drafter == "none":
        return None, notes
    if plan.drafter == "head" and setup.head_dir is not None:
        devices = [plan.head_device] + (["cpu"] if plan.head_device != "cpu" else [])
        for device in devices:
            try:
                return make_drafter("head", target=target, head_dir=setup.head_dir,
                                    device=device, mode=plan.budget.mode,
                                    depth=plan.budget.depth,
                                    top_k=plan.budget.top_k,
                                    draft_ahead=plan.layout == "duodecoding"), notes
            except Exception as exc:  # noqa: BLE001 - out of memory, no device, bad file
                log.warning("draft head on %s failed: %s", device, exc)
                notes.append(f"the draft head could not run on {device} ({exc})")
        notes.append("using prompt lookup instead")
    return make_drafter("lookup"), notes


def new_governor(plan: Plan) -> SpeculationGovernor | None:
    """The governor guards a draft model, whose every draft costs time. Prompt lookup
    costs ~nothing when it has no match and its hits come in bursts that a pause would
    miss: the per-step budget (its learnt acceptance against the verify cost) is the
    right judge there."""
    return SpeculationGovernor() if plan.drafter == "head" else None


@dataclass
class EngineSetup:
    """What generations need besides the target: drafter, governor, budget."""

    drafter: Drafter | None
    governor: SpeculationGovernor | None
    max_draft: int
    notes: list[str] = field(default_factory=list)
    planned: PlannedSetup | None = None  # set when the planner chose ("auto")
    target: Target | None = None  # the target to use (reopened if the plan moved it)


def prepare_engine(target: Target, drafter_name: str = "auto", head_dir: Path | None = None,
                   head_device: str = "cpu", overrides: Overrides | None = None,
                   recalibrate: bool = False, cache_dir: Path | None = None,
                   progress: Callable[[str], None] | None = None, move_target: bool = True
                   ) -> EngineSetup:
    """``auto``: the planner's choice (and a governor); any other name: that drafter as
    asked, with the budget of ``overrides`` if given. ``move_target`` False keeps the
    target where it is (a benchmark comparing layouts on one loaded model)."""
    ov = overrides or Overrides()
    if drafter_name == "auto":
        planned = plan_for(target, head_dir, ov, recalibrate, cache_dir, progress=progress)
        moved: list[str] = []
        if move_target:
            target, moved = target_for_plan(target, planned.plan)
        drafter, notes = build_drafter(planned, target)
        return EngineSetup(drafter, new_governor(planned.plan), planned.plan.budget.max_draft,
                           planned.notes + moved + notes, planned, target)
    options: dict = {}
    if drafter_name.startswith("head"):
        options = {"head_dir": head_dir, "device": head_device}
        if ov.depth:
            options["depth"] = ov.depth
    drafter = make_drafter(drafter_name, target=target, **options)
    max_draft = 8 if ov.max_draft is None else ov.max_draft
    return EngineSetup(drafter, None, max_draft, target=target)


def target_for_plan(target: Target, plan: Plan) -> tuple[Target, list[str]]:
    """``target`` reopened with the plan's GPU layers when they differ (the GPU failing
    to take them means the CPU, and a note)."""
    want = plan.target_gpu_layers
    if want == target.n_gpu_layers:
        return target, []
    path, config = target.path, target.config
    target.close()
    try:
        return Target(path, replace(config, n_gpu_layers=want)), []
    except TandemError as exc:
        return (Target(path, replace(config, n_gpu_layers=0)),
                [f"the GPU could not take the model ({exc}); it runs on the CPU"])
