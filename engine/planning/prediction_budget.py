"""How far a prediction (OpenAI's Predicted Outputs, engine.drafters.prediction) may
draft, from where the target runs and what the exactness probe found there.

A prediction's drafts are verified in batches, so its answer is plain decoding's only
where a verified batch gives one-token decoding's logits. That is the probe's verdict
for the kernels the target runs on now: the CPU's (engine.planning.kernels, also through
workers) while every layer is on the CPU, the GPU's (probed by the plan maker) once any
layer is on a GPU, whose matrix kernels change with the batch size. The planner gives
drafts from memory no budget on a GPU that failed its probe (engine.planning.planner);
a prediction follows the same rule.

Pure functions of (placement, probe verdicts), so their table is tested without a GPU.
"""

from __future__ import annotations

from engine.decoding.budget import MAX_MEMORY_DRAFT
from engine.drafters.kinds import DrafterKind

INEXACT_WARNING = ("drafts were verified on kernels the exactness probe found batch-variant "
                   "(a drafter chosen by name): greedy output can differ from plain "
                   "decoding at near-ties")


def verifies_exactly(cpu_exact: bool | None, gpu_layers: int, gpu_exact: bool | None
                     ) -> bool:
    """Whether a verified batch equals one-token decoding where the target runs:
    ``gpu_layers`` (0: all on the CPU or workers; -1 or more: some on a GPU) picks the
    CPU probe's verdict ``cpu_exact`` or the GPU probe's ``gpu_exact``. A verdict never
    given (None: not probed, or a model that decodes plainly anyway) is not exact."""
    verdict = gpu_exact if gpu_layers else cpu_exact
    return verdict is True


def prediction_budget(why_plain: str | None, exact_here: bool, gpu_layers: int,
                      asked: DrafterKind, target_max_draft: int | None) -> int:
    """The longest draft a prediction may make: 0 (plain decoding) where the model's
    header rules speculation out (``why_plain``), where the target runs on a GPU whose
    kernels are not exact (as the planner does for every drafter there), or where the
    CPU's are not and no drafter was chosen by name (``auto``, ``none``); else long
    drafts, as far as the target takes them back (``target_max_draft``, None: no
    limit)."""
    if why_plain is not None or exact_here:
        budget = 0 if why_plain is not None else MAX_MEMORY_DRAFT
    elif gpu_layers:
        budget = 0  # drafts verified on batch-variant GPU kernels: plain decoding there
    else:
        # A drafter chosen by name speculates on inexact CPU kernels as asked (and the
        # answer says so: ``answer_is_exact``); auto and none decode plainly.
        budget = 0 if asked in (DrafterKind.AUTO, DrafterKind.NONE) else MAX_MEMORY_DRAFT
    return budget if target_max_draft is None else min(budget, target_max_draft)


def answer_is_exact(drafter: str, exact_here: bool) -> bool:
    """Whether an answer is plain decoding's by construction: no drafter ran in it
    (``drafter``: its name in the answer's stats, ``none`` for plain decoding), or its
    drafts were verified on exact kernels (``exact_here``)."""
    return drafter == DrafterKind.NONE or exact_here


def exactness_figures(drafter: str, exact_here: bool) -> dict[str, object]:
    """The API's word on one answer (``tandem.exact``, with ``tandem.warning`` when
    False): whether it is plain decoding's answer by construction."""
    if answer_is_exact(drafter, exact_here):
        return {"exact": True}
    return {"exact": False, "warning": INEXACT_WARNING}
