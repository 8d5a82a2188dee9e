"""Generation statistics as values: the CLI, the bench and the dashboard show these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from engine.drafters.kinds import DrafterKind

# The drafter call that raised mid-generation (empty: none did).
DrafterCall = Literal["", "begin", "draft", "draft_ahead", "verifying", "accept", "finish"]


@dataclass(frozen=True)
class StepStats:
    """One verification cycle."""

    t_draft_s: float
    t_verify_s: float
    n_proposed: int  # draft tokens sent to the target
    n_accepted: int  # draft tokens the target kept (the bonus token not counted)
    accepted_depths: tuple[int, ...] = ()  # depth of each accepted draft token
    drafted_ahead: bool = False  # the draft was made while the previous step verified
    n_past: int = 0  # tokens cached before the step (its batch's context)
    drafter_asked: bool = False  # the drafter was asked (not paused, not plain)
    # Seconds from its end to its report: a plain greedy run reports its tokens together.
    reported_after_s: float = 0.0


@dataclass
class GenerationStats:
    n_prompt: int = 0
    n_prompt_reused: int = 0  # prompt tokens found in the KV cache already
    n_new: int = 0
    t_prefill_s: float = 0.0
    ttft_s: float = 0.0
    t_total_s: float = 0.0
    drafter: str = DrafterKind.NONE
    fallback: str = ""  # why drafting stopped mid-generation (empty: it did not)
    # Which drafter call raised, so that a check tells a drafter that crashed while
    # answering (the answer went on plainly) from one that never drafted: one refused
    # when the engine was built is in the engine's notes, never here.
    drafter_failed_in: DrafterCall = ""
    steps: list[StepStats] = field(default_factory=list)
    # A prediction's tokens the target verified and kept, or turned down (OpenAI's
    # accepted_prediction_tokens and rejected_prediction_tokens).
    n_prediction_accepted: int = 0
    n_prediction_rejected: int = 0

    @classmethod
    def so_far(cls, steps: list[StepStats], drafter: str, ttft_s: float, t_elapsed_s: float
               ) -> GenerationStats:
        """The figures of a generation still running, from its steps so far (the first
        token, then each step's accepted drafts and the target's own token)."""
        return cls(n_new=1 + sum(s.n_accepted + 1 for s in steps), ttft_s=ttft_s,
                   t_total_s=t_elapsed_s, drafter=drafter, steps=list(steps))

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def tok_per_s(self) -> float:
        """Decode speed after the first token (prefill excluded)."""
        t = self.t_total_s - self.ttft_s
        return (self.n_new - 1) / t if self.n_new > 1 and t > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens gained per verification, the target's own token included (tau)."""
        if not self.steps:
            return 0.0
        return sum(s.n_accepted + 1 for s in self.steps) / len(self.steps)

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(s.n_proposed for s in self.steps)
        return sum(s.n_accepted for s in self.steps) / proposed if proposed else 0.0

    @property
    def t_draft_s(self) -> float:
        return sum(s.t_draft_s for s in self.steps)

    @property
    def t_verify_s(self) -> float:
        return sum(s.t_verify_s for s in self.steps)

    @property
    def n_drafted_ahead(self) -> int:
        return sum(s.drafted_ahead for s in self.steps)

    def acceptance_by_depth(self, max_depth: int = 16) -> list[int]:
        """How many accepted draft tokens sat at each depth 1..max_depth."""
        counts = [0] * max_depth
        for s in self.steps:
            for d in s.accepted_depths:
                if 1 <= d <= max_depth:
                    counts[d - 1] += 1
        return counts

    def summary(self) -> dict[str, float | int | str]:
        """A flat, JSON-ready view (steps left out)."""
        d = {k: v for k, v in asdict(self).items() if k != "steps"}
        d.update(n_steps=self.n_steps, tok_per_s=self.tok_per_s,
                 mean_accepted=self.mean_accepted, acceptance_rate=self.acceptance_rate,
                 t_draft_s=self.t_draft_s, t_verify_s=self.t_verify_s,
                 n_drafted_ahead=self.n_drafted_ahead)
        return d
