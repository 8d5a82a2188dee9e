"""One generation loop for every mode: plain decoding and speculative decoding.

Phases: ``_prefill`` (prompt -> first token), ``_step`` until an end condition (draft or
not, verify ``[last, *draft]`` in one decode, accept, commit the accepted path), then
``_finish``. Values pass between phases as arguments and return values.
With no drafter a step is exactly plain decoding, so both modes share every line that
touches the target and the sampler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from engine.decoding.acceptance import accept
from engine.decoding.budget import (
    MAX_DRAFT,
    SpeculationGovernor,
    VerifyCost,
    VerifyCostModel,
    trim_to_budget,
)
from engine.decoding.grammar import Grammar
from engine.decoding.logprobs import TokenLogprob, logprob_of
from engine.decoding.sampling import PositionUniforms, SamplingParams, choose, penalised
from engine.decoding.stats import DrafterCall, GenerationStats, StepStats
from engine.decoding.target_contract import DecodingTarget
from engine.drafters.base import Drafter
from engine.drafters.kinds import DrafterKind
from engine.errors import InvalidSamplingError
from engine.runtime.draft_tree import DraftTree
from engine.runtime.text_stream import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    max_draft: int = MAX_DRAFT  # draft tokens verified per step, on top of the root
    grammar: str | None = None  # GBNF (engine.decoding.grammar): every token obeys it
    # The target's log probability of each answer token and of its ``logprobs`` likeliest
    # alternatives (None: not reported).
    logprobs: int | None = None
    # A text the answer is expected to repeat (OpenAI's Predicted Outputs: the file being
    # edited). The engine drafts from it (engine.drafters.prediction); never changes output.
    prediction: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingError("max_tokens", "must be an integer >= 1", self.max_tokens)
        if self.max_draft < 0:
            raise InvalidSamplingError("max_draft", "must be >= 0", self.max_draft)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidSamplingError("top_logprobs", "must be between 0 and 20",
                                       self.logprobs)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "eos", "stop", "length", "context", "cancelled"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token, where asked for


class _Emitter:
    """Applies end conditions token by token and streams text."""

    def __init__(self, target: DecodingTarget, config: GenerationConfig,
                 on_text: Callable[[str], None] | None,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> None:
        self.target = target
        self.max_tokens = config.max_tokens
        self.stream = TextStream(config.stop)
        self.on_text = on_text
        self.on_logprobs = on_logprobs
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if config.logprobs is not None else None
        self.n_logprobs_sent = 0
        self.finish_reason: str | None = None

    def _send_text(self, delta: str) -> None:
        """``delta`` to ``on_text``, after the log probabilities of the tokens it ends
        (every one not sent yet) to ``on_logprobs``."""
        if self.on_logprobs is not None and self.logprobs:
            fresh = self.logprobs[self.n_logprobs_sent:]
            if fresh:
                self.on_logprobs(fresh)
                self.n_logprobs_sent = len(self.logprobs)
        if self.on_text:
            self.on_text(delta)

    def emit(self, tokens: list[int], logprobs: Sequence[TokenLogprob] = ()) -> None:
        for i, tok in enumerate(tokens):
            if self.finish_reason is not None:
                return
            if self.target.is_end_of_generation(tok):
                self.finish_reason = "eos"
                return
            self.tokens.append(tok)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i])
            delta = self.stream.feed(self.target.token_bytes(tok))
            if delta:
                self._send_text(delta)
            if self.stream.stopped:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"

    def close(self) -> str:
        if self.finish_reason is None:
            self.finish_reason = "length"
        tail = self.stream.finish()
        if tail:
            self._send_text(tail)
        return self.finish_reason


def generate(
    target: DecodingTarget,
    prompt: list[int],
    drafter: Drafter | None = None,
    config: GenerationConfig | None = None,
    on_text: Callable[[str], None] | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    cost: VerifyCostModel | None = None,
    governor: SpeculationGovernor | None = None,
    remember: bool = True,
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
) -> GenerationResult:
    """Generate after ``prompt``; output equals plain decoding whatever the drafter.
    ``target`` is anything that answers ``DecodingTarget`` (engine.decoding.target_contract):
    the engine's ``Target``, or a parallel lane's ``LaneTarget``.

    ``on_logprobs`` (where ``config.logprobs`` asks for them) receives the log
    probabilities of the tokens whose text ``on_text`` is about to receive, just before it.

    ``should_stop`` is polled between steps (cancellation). ``cost`` is the verification
    cost curve the draft budget uses; it learns from this generation's decodes (pass
    the same one across generations to keep what it learnt). Raises ContextFullError
    when the prompt does not fit (the engine stays usable), NativeError on a failed
    decode. ``governor`` (optional) turns drafting off while it does not pay. A
    drafter that fails (a GPU that vanishes, out of memory) is dropped for the rest of
    the generation, which goes on as plain decoding; ``stats.fallback`` says why and
    ``stats.drafter_failed_in`` which call raised (checks of drafting count it a failure).
    ``remember`` False keeps the answer out of a drafter's memory (a benchmark's repeat).
    """
    config = config or GenerationConfig()
    grammar = Grammar.compile(target.model, config.grammar) if config.grammar else None
    run = _Run(target, config, cost if cost is not None else VerifyCostModel(), governor,
               _Emitter(target, config, on_text, on_logprobs),
               GenerationStats(n_prompt=len(prompt),
                               drafter=drafter.name if drafter else DrafterKind.NONE),
               PositionUniforms(config.sampling.seed), drafter, prompt=list(prompt),
               grammar=grammar)
    t0 = time.perf_counter()
    last = _prefill(run, prompt, t0)
    ahead_pool = (ThreadPoolExecutor(1, thread_name_prefix="draft-ahead")
                  if run.drafter is not None and run.drafter.drafts_ahead else None)
    try:
        while run.emitter.finish_reason is None:
            if should_stop is not None and should_stop():
                run.emitter.finish_reason = "cancelled"
                break
            step = _step(run, last, ahead_pool)
            if step is None:
                break
            last, steps, new_tokens, logprobs = step
            if on_step is not None:
                for step_stats in steps:
                    on_step(step_stats)
            run.emitter.emit(new_tokens, logprobs)
    finally:
        if ahead_pool is not None:
            ahead_pool.shutdown(wait=True)
        if run.grammar is not None:
            run.grammar.close()
    return _finish(run, prompt, t0, remember)


@dataclass
class _Run:
    """What one generation carries from phase to phase."""

    target: DecodingTarget
    config: GenerationConfig
    cost: VerifyCostModel
    governor: SpeculationGovernor | None
    emitter: _Emitter
    stats: GenerationStats
    uniforms: PositionUniforms  # one per answer position, whatever was drafted
    drafter: Drafter | None  # None once it failed: the rest is plain decoding
    n_sampled: int = 1  # answer positions decided (the first token by the prefill)
    # Steps in a row the drafter was asked and proposed nothing (the next plain runs
    # grow with them: _undrafted_run)
    empty_asks: int = 0
    prompt: list[int] = field(default_factory=list)
    grammar: Grammar | None = None  # its state after every token emitted so far

    # Every token is the argmax of the target's raw logits: greedy, no penalty, no
    # grammar, no log probabilities asked (set once: read every step).
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.plain_greedy = (c.sampling.greedy and not c.sampling.has_penalties
                             and self.grammar is None and c.logprobs is None)

    def choice_row(self, logits: np.ndarray, extra: Sequence[int] = (),
                   grammar: Grammar | None = None) -> np.ndarray:
        """The row a token is chosen from, after the answer so far plus ``extra``:
        penalised, then constrained by ``grammar`` (that position's state). Plain and
        drafted decoding choose every token through here."""
        row = penalised(logits, self.penalty_window(extra), self.config.sampling)
        if grammar is not None:
            row = grammar.constrain(row, self.config.sampling.greedy)
        return row

    def penalty_window(self, extra: Sequence[int] = ()) -> list[int]:
        """The tokens a penalty looks at before the position after ``extra``: the last
        ``penalty_last_n`` of prompt + answer so far + ``extra``."""
        if not self.config.sampling.has_penalties:  # also: a window of 0 tokens
            return []
        n = self.config.sampling.penalty_last_n
        return (self.prompt[-n:] + self.emitter.tokens[-n:] + list(extra))[-n:]

    def logits_of(self, logits: np.ndarray, tree: DraftTree,
                  states: Sequence[Grammar] = ()) -> Callable[[int], np.ndarray]:
        """Node (verification numbering) -> the row its next token is chosen from:
        penalised with the node's own prefix (the answer so far plus the drafted tokens
        on the path down to it) and constrained by ``states[node]``, the grammar's state
        after that prefix."""
        if not self.config.sampling.has_penalties and not states:
            return logits.__getitem__

        def of(node: int) -> np.ndarray:
            path: list[int] = []
            i = node - 1
            while i >= 0:
                path.append(tree.tokens[i])
                i = tree.parents[i]
            return self.choice_row(logits[node], path[::-1], states[node] if states else None)
        return of

    def drop_drafter(self, exc: Exception, call: DrafterCall) -> None:
        """Go on without the drafter: the target alone decides every token anyway (the
        user keeps the answer; ``stats.drafter_failed_in`` names the ``call`` that
        raised, for the checks that must not take a fallback for drafting)."""
        assert self.drafter is not None
        name = self.drafter.name
        log.warning("drafter %s failed in %s (%s); continuing with plain decoding", name,
                    call, exc)
        self.stats.fallback = f"the {name} drafter failed ({exc}); went on with plain decoding"
        self.stats.drafter_failed_in = call
        self.drafter = None


def _prefill(run: _Run, prompt: list[int], t0: float) -> int:
    """Evaluate the prompt and choose the first token (no drafting before it)."""
    drafter, target = run.drafter, run.target
    target.set_features(bool(drafter and drafter.needs_features))
    pre = target.prefill(prompt, drafter.prompt_features if drafter else None)
    run.stats.n_prompt_reused = pre.n_reused
    last = choose(run.choice_row(pre.logits, grammar=run.grammar), run.config.sampling,
                  run.uniforms.at(0))
    run.stats.t_prefill_s = time.perf_counter() - t0
    logprobs = ([logprob_of(pre.logits, last, run.config.logprobs, target.token_bytes)]
                if run.config.logprobs is not None else [])
    _advance(run.grammar, [last])
    run.emitter.emit([last], logprobs)
    run.stats.ttft_s = time.perf_counter() - t0
    if drafter is not None and run.emitter.finish_reason is None:
        try:
            drafter.begin(prompt + [last], pre.features)
        except Exception as exc:  # noqa: BLE001 - any drafter failure
            run.drop_drafter(exc, "begin")
    return last


def _room(run: _Run) -> int:
    """KV cells left after the root (compacting parked cells when they run short)."""
    target = run.target
    room = target.n_ctx - target.n_used - 1
    if room < run.config.max_draft and target.n_parked:
        target.compact()
        room = target.n_ctx - target.n_used - 1
    return room


def _draft(run: _Run, room: int, cost: VerifyCost) -> tuple[DraftTree, bool]:
    """The draft for this step, trimmed to what pays (empty: a plain step), and whether
    the drafter was asked."""
    drafter, governor = run.drafter, run.governor
    if drafter is None or (governor is not None and not governor.should_draft()):
        return DraftTree(), False
    budget = min(run.config.max_draft, room, run.config.max_tokens - len(run.emitter.tokens))
    if run.target.max_draft is not None:  # recurrent state: as far as its snapshots reach
        budget = min(budget, run.target.max_draft)
    if budget <= 0:
        return DraftTree(), True
    forced = _forced_draft(run, budget)
    if forced:
        return trim_to_budget(forced, cost), True
    try:
        proposed = drafter.draft(budget, cost.t1).truncated(budget)
    except Exception as exc:  # noqa: BLE001 - any drafter failure
        run.drop_drafter(exc, "draft")
        return DraftTree(), True
    if not run.target.trees or run.grammar is not None:
        proposed = proposed.best_chain()
    # A merged tree (head and memory) can have more leaves than the target has sequences.
    return trim_to_budget(proposed, cost).with_leaves_at_most(run.target.max_leaves), True


# The likelihood a draft of the grammar's only way on is taken, per token: near certain, but
# the model may split the text into other tokens than the tokenizer does.
FORCED_SCORE = 0.95


def _forced_draft(run: _Run, budget: int) -> DraftTree:
    """Where the grammar admits one text only from here (a schema's next key and its
    punctuation), that text's tokens as the draft; empty elsewhere."""
    if run.grammar is None:
        return DraftTree()
    text = run.grammar.forced_text()
    if len(text) < 2:  # one character: one token either way
        return DraftTree()
    draft, node, score = DraftTree(), -1, 1.0
    for tok in run.target.tokenize(text, special=False)[:budget]:
        score *= FORCED_SCORE
        node = draft.add(tok, node, score)
    return draft


def _advance(grammar: Grammar | None, tokens: Sequence[int]) -> None:
    """Move the grammar past the answer's new tokens (an end of generation ends it)."""
    if grammar is None:
        return
    for tok in tokens:
        if tok in grammar.eog:
            return
        grammar.accept(tok)


def _grammar_states(run: _Run, draft: DraftTree) -> tuple[DraftTree, list[Grammar]]:
    """The draft cut before its first token the grammar forbids (a chain), and the
    grammar's state at each verified node: [the state now, after draft token 1, ...].
    The states past the root are copies, the caller's to close."""
    assert run.grammar is not None
    states = [run.grammar]
    for tok in draft.tokens:
        state = states[-1]
        if tok in state.eog or not state.allowed(tok):
            break
        nxt = state.clone()
        nxt.accept(tok)
        states.append(nxt)
    n = len(states) - 1
    return (draft if n == len(draft) else draft.truncated(n)), states


def _step(run: _Run, last: int, ahead_pool: ThreadPoolExecutor | None
          ) -> tuple[int, tuple[StepStats, ...], list[int], list[TokenLogprob]] | None:
    """Draft, verify, accept, commit. Returns the new last token, the step's figures (a
    plain greedy run's: one per token), the tokens it added and their log probabilities
    (where asked for), or None when the context is full."""
    target = run.target
    room = _room(run)
    if room < 0:
        run.emitter.finish_reason = "context"
        return None
    if run.plain_greedy and run.drafter is None:
        return _plain_greedy_run(run, last, room)
    t_step = time.perf_counter()
    n_past = target.n_past
    cost = run.cost.at(n_past)
    draft, drafting = _draft(run, room, cost)
    if draft:
        run.empty_asks = 0
    if not draft and _plain_in_c(run):
        return _undrafted_run(run, last, room, n_past, drafting,
                              time.perf_counter() - t_step, cost.t1)
    states: list[Grammar] = []
    if run.grammar is not None:
        draft, states = _grammar_states(run, draft)
    t_drafted = time.perf_counter()
    ahead: Future | None = None
    if ahead_pool is not None and run.drafter is not None and draft:
        ahead = ahead_pool.submit(run.drafter.draft_ahead, draft, run.config.max_draft,
                                  cost.t1)
    if run.drafter is not None and draft:
        try:
            run.drafter.verifying(draft)
        except Exception as exc:  # noqa: BLE001 - any drafter failure
            run.drop_drafter(exc, "verifying")
    ver = target.verify(last, draft)
    run.cost.observe(n_past, 1 + len(draft), time.perf_counter() - t_drafted)
    if ahead is not None:
        try:
            ahead.result()  # a draft ahead slower than the verification costs here
        except Exception as exc:  # noqa: BLE001 - any drafter failure
            run.drop_drafter(exc, "draft_ahead")
    node_tokens = [last] + draft.tokens
    n_sampled = run.n_sampled
    acc = accept(draft.children(), node_tokens, run.logits_of(ver.logits, draft, states),
                 run.config.sampling, lambda depth: run.uniforms.at(n_sampled + depth))
    run.n_sampled += len(acc.path)
    path_tokens = [node_tokens[k] for k in acc.path]
    new_tokens = path_tokens[1:] + [acc.next_token]
    logprobs = ([logprob_of(ver.logits[k], tok, run.config.logprobs, target.token_bytes)
                 for k, tok in zip(acc.path, new_tokens, strict=True)]
                if run.config.logprobs is not None else [])
    if states:  # the accepted node's state, then past the target's own token
        kept = states[acc.path[-1]]
        for state in states:
            if state is not kept:
                state.close()
        run.grammar = kept
        _advance(run.grammar, [acc.next_token])
    target.commit(ver, acc.path, path_tokens)
    t_verified = time.perf_counter()
    if run.drafter is not None:
        feats = ver.features[acc.path] if ver.features is not None else None
        try:
            run.drafter.accept(new_tokens, feats)
        except Exception as exc:  # noqa: BLE001 - any drafter failure
            run.drop_drafter(exc, "accept")
    if drafting and run.governor is not None:
        run.governor.observe(len(acc.path) - 1, t_drafted - t_step, t_verified - t_drafted,
                             cost.t1, len(draft))
    step = StepStats(t_draft_s=t_drafted - t_step, t_verify_s=t_verified - t_drafted,
                     n_proposed=len(draft), n_accepted=len(acc.path) - 1,
                     accepted_depths=tuple(range(1, len(acc.path))),
                     drafted_ahead=draft.made_ahead, n_past=n_past,
                     drafter_asked=drafting)
    run.stats.steps.append(step)
    return acc.next_token, (step,), new_tokens, logprobs


# A plain greedy run decodes about this long before its text streams and a stop is heard.
PLAIN_RUN_SECONDS = 0.05
PLAIN_RUN_MAX_TOKENS = 16


def _plain_in_c(run: _Run) -> bool:
    """Whether a step with nothing to verify can decode as plain decoding does, in C: a
    plain greedy answer whose drafter reads no hidden states (they would be missing)."""
    return run.plain_greedy and run.drafter is not None and not run.drafter.needs_features


EMPTY_RUN_MAX = 8  # tokens a plain run takes after a drafter's empty asks (a power of 2)


def _undrafted_run(run: _Run, last: int, room: int, n_past: int, asked: bool,
                   t_draft_s: float, t1_s: float
                   ) -> tuple[int, tuple[StepStats, ...], list[int], list[TokenLogprob]]:
    """A step without a draft, decoded as plain decoding's run: as many tokens as the
    governor's pause leaves when the drafter was not asked; when it was asked and had
    nothing, 1, 2, 4, then EMPTY_RUN_MAX tokens as its empty asks go on in a row (it may
    draft after them; a proposal starts again at 1); the drafter then reads the tokens. A
    single-token step through Python cost ~10% more a token than the C run at 1,000 tokens
    of context and ~15% after a 7k-token tool result (docs/benchmarks.md, "Documents and
    code edits", "Tool loops"): a drafter finding nothing for a long answer made it that
    much slower than plain decoding, the governor seeing only its microseconds."""
    governor = run.governor
    n = 1
    if asked:
        run.empty_asks += 1
        n = min(_plain_run_length(run, room, n_past),
                1 << min(run.empty_asks - 1, EMPTY_RUN_MAX.bit_length() - 1))
    elif governor is not None:
        n = min(_plain_run_length(run, room, n_past), 1 + governor.pause_left)
        governor.pause_left -= n - 1
        governor.n_paused += n - 1
    last, steps, chosen, logprobs = _plain_greedy_run(run, last, room, n)
    if asked:  # the drafter's time went for nothing: the governor weighs it
        steps = (replace(steps[0], drafter_asked=True, t_draft_s=t_draft_s), *steps[1:])
        run.stats.steps[-len(steps):] = steps
        if governor is not None:
            governor.observe(0, t_draft_s, 0.0, t1_s, 0)
    assert run.drafter is not None
    try:
        run.drafter.accept(list(chosen), None)
    except Exception as exc:  # noqa: BLE001 - any drafter failure
        run.drop_drafter(exc, "accept")
    return last, steps, chosen, logprobs


def _plain_greedy_run(run: _Run, last: int, room: int, n: int | None = None
                      ) -> tuple[int, tuple[StepStats, ...], list[int], list[TokenLogprob]]:
    """``_step`` without a drafter, greedy, on the raw logits, for a run of tokens: each the
    target's argmax after the one before, the token ``accept_greedy`` takes from the same
    row. The run stays in C (``Target.decode_greedy``): Python between two decodes ran on
    caches the decode had flushed, 0.1-0.2 ms a token (2-4% of a small model's)."""
    target = run.target
    n_past = target.n_past
    chosen, seconds = target.decode_greedy(
        last, _plain_run_length(run, room, n_past) if n is None else n)
    steps = []
    after = sum(seconds)
    for k, t_s in enumerate(seconds):
        run.cost.observe(n_past + k, 1, t_s)
        after = after - t_s if k < len(seconds) - 1 else 0.0
        steps.append(StepStats(t_draft_s=0.0, t_verify_s=t_s, n_proposed=0, n_accepted=0,
                               n_past=n_past + k, reported_after_s=max(after, 0.0)))
    run.n_sampled += len(chosen)
    run.stats.steps.extend(steps)
    return chosen[-1], tuple(steps), chosen, []


def _plain_run_length(run: _Run, room: int, n_past: int) -> int:
    """How many tokens the next plain greedy run may choose: about PLAIN_RUN_SECONDS'
    worth, within the context's ``room`` and the answer's length. One where a stop string
    may end the answer inside the run and the target's recurrent state could not be taken
    back to it, and where the target decodes a token at a time anyway."""
    target = run.target
    if not target.greedy_in_c or (run.config.stop and target.arch.has_state):
        return 1
    if not run.cost.knows_t1:  # a slow model's first run must not be long unknowingly
        return 1
    t1 = run.cost.at(n_past).t1
    n = int(PLAIN_RUN_SECONDS / t1) if t1 > 0 else 1
    left = run.config.max_tokens - len(run.emitter.tokens)
    return max(1, min(n, PLAIN_RUN_MAX_TOKENS, room + 1, left))


def _finish(run: _Run, prompt: list[int], t0: float, remember: bool) -> GenerationResult:
    """Close the text stream, let the drafter remember the answer, fill the figures."""
    reason = run.emitter.close()
    tokens = run.emitter.tokens
    # Leave the cache as plain decoding leaves it: every token but the last, which plain
    # decoding has not evaluated yet, except after an end of generation, which the last
    # token's decode predicted. A verified batch may have evaluated more; a next turn
    # that shifts its cache over dropped turns would then keep a token plain decoding
    # evaluates afresh. (Taking back a token plain decoding keeps would make a hybrid
    # without snapshots read the whole conversation again, in other sums.)
    plain_past = len(prompt) + len(tokens) - (0 if reason == "eos" else 1)
    if run.target.n_past > plain_past >= len(prompt):
        run.target.rollback(plain_past)
    if run.drafter is not None and remember:
        try:
            run.drafter.finish(prompt + tokens)
        except Exception as exc:  # noqa: BLE001 - the answer is complete anyway
            run.drop_drafter(exc, "finish")
    run.stats.n_new = len(tokens)
    run.stats.t_total_s = time.perf_counter() - t0
    return GenerationResult(tokens, run.emitter.stream.text, reason, run.stats,
                            run.emitter.logprobs)
