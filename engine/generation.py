"""One generation loop for every mode: plain decoding and speculative decoding.

Phases: prefill (prompt -> first token), then steps. A step drafts (or not), verifies
``[last, *draft]`` in one decode, accepts, commits the accepted path, and emits tokens.
With no drafter a step is exactly plain decoding, so both modes share every line that
touches the target and the sampler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from engine.acceptance import accept
from engine.budget import SpeculationGovernor, VerifyCostModel, trim_to_budget
from engine.draft_tree import DraftTree
from engine.drafters.base import Drafter
from engine.errors import InvalidSamplingError
from engine.sampling import SamplingParams, choose
from engine.stats import GenerationStats, StepStats
from engine.target import Target
from engine.text_stream import TextStream

_EMPTY_DRAFT = DraftTree()
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    max_draft: int = 8  # draft tokens verified per step, on top of the root

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.max_draft < 0:
            raise InvalidSamplingError(f"max_draft must be >= 0, got {self.max_draft!r}")


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "eos", "stop", "length", "context", "cancelled"
    stats: GenerationStats


class _Emitter:
    """Applies end conditions token by token and streams text."""

    def __init__(self, target: Target, config: GenerationConfig,
                 on_text: Callable[[str], None] | None) -> None:
        self.target = target
        self.max_tokens = config.max_tokens
        self.stream = TextStream(config.stop)
        self.on_text = on_text
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    def emit(self, tokens: list[int]) -> None:
        for tok in tokens:
            if self.finish_reason is not None:
                return
            if self.target.is_end_of_generation(tok):
                self.finish_reason = "eos"
                return
            self.tokens.append(tok)
            delta = self.stream.feed(self.target.token_bytes(tok))
            if delta and self.on_text:
                self.on_text(delta)
            if self.stream.stopped:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"

    def close(self) -> str:
        if self.finish_reason is None:
            self.finish_reason = "length"
        tail = self.stream.finish()
        if tail and self.on_text:
            self.on_text(tail)
        return self.finish_reason


def generate(
    target: Target,
    prompt: list[int],
    drafter: Drafter | None = None,
    config: GenerationConfig | None = None,
    on_text: Callable[[str], None] | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    cost: VerifyCostModel | None = None,
    governor: SpeculationGovernor | None = None,
) -> GenerationResult:
    """Generate after ``prompt``; output equals plain decoding whatever the drafter.

    ``should_stop`` is polled between steps (cancellation). ``cost`` is the verification
    cost curve the draft budget uses; it learns from this generation's decodes (pass
    the same one across generations to keep what it learnt). Raises ContextFullError
    when the prompt does not fit (the engine stays usable), NativeError on a failed
    decode. ``governor`` (optional) turns drafting off while it does not pay. A
    drafter that fails (a GPU that vanishes, out of memory) is dropped for the rest of
    the generation, which goes on as plain decoding; ``stats.fallback`` says why.
    """
    config = config or GenerationConfig()
    cost = cost if cost is not None else VerifyCostModel()
    params = config.sampling
    rng = np.random.default_rng(params.seed)
    stats = GenerationStats(n_prompt=len(prompt), drafter=drafter.name if drafter else "none")
    emitter = _Emitter(target, config, on_text)
    t0 = time.perf_counter()

    target.set_features(bool(drafter and drafter.needs_features))
    pre = target.prefill(prompt, drafter.prompt_features if drafter else None)
    stats.n_prompt_reused = pre.n_reused
    last = choose(pre.logits, params, rng)
    stats.t_prefill_s = time.perf_counter() - t0
    emitter.emit([last])
    stats.ttft_s = time.perf_counter() - t0
    if drafter is not None and emitter.finish_reason is None:
        try:
            drafter.begin(prompt + [last], pre.features)
        except Exception as exc:  # noqa: BLE001 - any drafter failure
            drafter = _drop_drafter(drafter, exc, stats)

    ahead_pool = (ThreadPoolExecutor(1, thread_name_prefix="draft-ahead")
                  if drafter is not None and drafter.drafts_ahead else None)
    try:
        drafter = _steps(target, drafter, config, cost, governor, emitter, stats, rng,
                         last, should_stop, on_step, ahead_pool)
    finally:
        if ahead_pool is not None:
            ahead_pool.shutdown(wait=True)
    reason = emitter.close()
    stats.n_new = len(emitter.tokens)
    stats.t_total_s = time.perf_counter() - t0
    return GenerationResult(emitter.tokens, emitter.stream.text, reason, stats)


def _steps(target: Target, drafter: Drafter | None, config: GenerationConfig,
           cost: VerifyCostModel, governor: SpeculationGovernor | None, emitter: _Emitter,
           stats: GenerationStats, rng: np.random.Generator, last: int,
           should_stop: Callable[[], bool] | None, on_step: Callable[[StepStats], None] | None,
           ahead_pool: ThreadPoolExecutor | None) -> Drafter | None:
    """Draft, verify, accept until the emitter says stop; the drafter still in use."""
    params = config.sampling
    while emitter.finish_reason is None:
        if should_stop is not None and should_stop():
            emitter.finish_reason = "cancelled"
            break
        room = target.n_ctx - target.n_used - 1  # cells left after the root
        if room < config.max_draft and target.n_parked:
            target.compact()
            room = target.n_ctx - target.n_used - 1
        if room < 0:
            emitter.finish_reason = "context"
            break
        t_step = time.perf_counter()
        cost.at_context(target.n_past)
        draft = _EMPTY_DRAFT
        drafting = drafter is not None and (governor is None or governor.should_draft())
        if drafting:
            budget = min(config.max_draft, room, config.max_tokens - len(emitter.tokens))
            if budget > 0:
                drafter.token_time_s = cost.t1
                try:
                    draft = trim_to_budget(drafter.draft(budget).truncated(budget), cost)
                except Exception as exc:  # noqa: BLE001 - any drafter failure
                    drafter = _drop_drafter(drafter, exc, stats)
                    draft = _EMPTY_DRAFT
        t_drafted = time.perf_counter()
        served_ahead = bool(drafter is not None and draft and drafter.served_ahead)
        ahead: Future | None = None
        if ahead_pool is not None and drafter is not None and draft:
            ahead = ahead_pool.submit(drafter.draft_ahead, draft, config.max_draft)
        ver = target.verify(last, draft)
        cost.observe(1 + len(draft), time.perf_counter() - t_drafted)
        if ahead is not None:
            try:
                ahead.result()  # a draft ahead slower than the verification costs here
            except Exception as exc:  # noqa: BLE001 - any drafter failure
                drafter = _drop_drafter(drafter, exc, stats)
        node_tokens = [last] + draft.tokens
        acc = accept(draft.children(), node_tokens, ver.logits, params, rng)
        path_tokens = [node_tokens[k] for k in acc.path]
        target.commit(ver, acc.path, path_tokens)
        t_verified = time.perf_counter()
        new_tokens = path_tokens[1:] + [acc.next_token]
        if drafter is not None:
            feats = ver.features[acc.path] if ver.features is not None else None
            try:
                drafter.accept(new_tokens, feats)
            except Exception as exc:  # noqa: BLE001 - any drafter failure
                drafter = _drop_drafter(drafter, exc, stats)
        if drafting and governor is not None:
            governor.observe(len(acc.path) - 1, t_drafted - t_step, t_verified - t_drafted,
                             cost.t1, len(draft))
        step = StepStats(t_draft_s=t_drafted - t_step, t_verify_s=t_verified - t_drafted,
                         n_proposed=len(draft), n_accepted=len(acc.path) - 1,
                         accepted_depths=tuple(range(1, len(acc.path))),
                         drafted_ahead=served_ahead)
        stats.steps.append(step)
        if on_step is not None:
            on_step(step)
        emitter.emit(new_tokens)
        last = acc.next_token
    return drafter


def _drop_drafter(drafter: Drafter, exc: Exception, stats: GenerationStats) -> None:
    """Go on without the drafter: the target alone decides every token anyway."""
    log.warning("drafter %s failed (%s); continuing with plain decoding", drafter.name, exc)
    stats.fallback = f"the {drafter.name} drafter failed ({exc}); went on with plain decoding"
    return None
