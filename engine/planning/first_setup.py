"""What the engine runs first: plain decoding where speculation cannot be exact (known
from the model's header, or for ``auto`` from kernels that are not exact), the drafter
asked for by name, or ``auto``'s plan priced from this machine's measured costs
(engine.planning.plan_maker)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from engine.decoding.budget import MAX_DRAFT, MAX_MEMORY_DRAFT
from engine.drafters.kinds import DrafterKind, Need
from engine.drafters.spec import DrafterSpec
from engine.planning.drafter_options import usable_eagle3_head
from engine.planning.kernels import KernelChoice
from engine.planning.plan_maker import PlanMaker, Setup
from engine.planning.planner import Overrides
from engine.runtime.model_info import ModelInfo
from engine.runtime.target import Target, TargetConfig


class Asked(Protocol):
    """What the user asked for (engine.session.EngineConfig's fields read here)."""

    drafter: DrafterKind
    head_dir: Path | None
    head_device: str
    draft_model: Path | None
    overrides: Overrides
    recalibrate: bool


def first_setup(asked: Asked, model: ModelInfo, kernels: KernelChoice | None,
                plans: PlanMaker, target_config: TargetConfig, say: Callable[[str], None],
                notes: list[str]) -> tuple[Setup, Target | None, str | None]:
    """What to run first, the target already opened for it (auto may have opened one
    to measure), and why (for the plan's log); ``notes`` get what the user is told."""
    name = model.path.name
    if model.why_plain is not None:  # known before any probe or measurement
        if asked.drafter.drafts:
            notes.append(f"{name} decodes plainly: {model.why_plain}")
        return Setup.plain(), None, None
    if asked.drafter is DrafterKind.AUTO and kernels is not None and not kernels.exact:
        notes.append(f"auto does not speculate on {name}: {kernels.describe()}. Choose a "
                     "drafter by name to speculate anyway")
        return Setup.plain(), None, None
    if asked.drafter is DrafterKind.AUTO:
        plans.gather_options(asked.head_dir, asked.draft_model, target_config)
        plan, opened = plans.plan_at_start(target_config, asked.recalibrate, say)
        return plans.setup_for(plan, asked.overrides.max_draft), opened, plans.start_why
    return asked_setup(asked, model), None, None


def asked_setup(asked: Asked, model: ModelInfo) -> Setup:
    """The drafter asked for by name, on the CPU, with the budget asked (or the
    drafter's default: long drafts for drafts from memory)."""
    options: dict[str, object] = {}
    if asked.overrides.depth:
        options["depth"] = asked.overrides.depth
    head_dir = asked.head_dir
    if Need.EAGLE3_GGUF in asked.drafter.needs and head_dir is None:
        # An imported head that fits this model, else the bundled model's.
        head_dir = usable_eagle3_head(model)
    spec = DrafterSpec(asked.drafter, head_dir, asked.head_device, options, asked.draft_model)
    cap = MAX_MEMORY_DRAFT if asked.drafter.uses_memory else MAX_DRAFT
    max_draft = asked.overrides.max_draft
    return Setup(0, spec, cap if max_draft is None else max_draft)
