"""A differential test of whole conversations: a plain session and one session per
drafter, driven through the same random user actions, must stay identical.

    .venv/bin/python -m tests.differential --seed 1 --minutes 60 [--model M.gguf]
        [--drafters memory,lookup,head,eagle3] [--out cases/]
    .venv/bin/python -m tests.differential --replay cases/case-1.json
    .venv/bin/python -m tests.differential --matrix --minutes 60 [--out cases/]
    .venv/bin/python -m tests.differential --matrix --actions 10000 [--segment 50] [--out cases/]

``--matrix`` shares the minutes among models and drafters (MATRIX: the bundled Q4_0 with
``auto``, an F32 copy with a draft model, and tiny hybrid, sliding-window, MoE and
latent-attention files with memory, lookup and their MTP blocks), writes each one's
counts as it ends and skips those a rerun with the same seed finds done. ``--actions N``
runs N actions over the matrix instead (shared as the minutes are), in segments of
``--segment`` actions, each a fresh set of sessions on a seed of its own, with a progress
bar; each segment's counts are written to ``out/matrix-actions-SEED.json`` as it ends, and
a rerun resumes after the last segment done (a divergence's case is one segment long).

Each session is the real answer path (``engine.conversation.AnswerService`` over an
``Engine`` with the drafter named, two threads). The actions are a user's: a new chat, a
follow-up, a regenerate, an edit of an earlier message and a switch back to the branch it
replaced, a stop after a few tokens, a long (RAG) prompt or a short one, seeded sampling, a
small token limit, and a chat that outgrows the context (its oldest turns dropped and the
cache shifted); the features' (tests/differential_features.py), each greedy or sampled with
a seed: an attached document (whole, its best passages, or whole after every session is
reloaded with the larger context the window asks for), a tool round (a call held by the
grammar, then the answer after its result), a predicted output (plain decoding's answer,
that answer perturbed, an unrelated text; the plain session answers without it) and a
JSON-schema answer, built by the window's and the API's own code; and the app's between
answers: a plan switch (a new draft budget) and, with
``auto``, measuring the machine again. After each action every session's answer must be
the plain session's token for token, with the same finish reason and the same text (as
streamed and as returned), no drafter may have failed while answering (the answer goes on
plainly for a user, but nothing was drafted after), and the first-token logits of a fixed
next question must be the same bytes (the caches alike; -0 is not +0). An error every
session raises is reported, and parts unless it is a refusal plain decoding gives on its own
(a prompt that does not fit, a bad setting); the caches are probed after it either way. A
divergence is written as a replayable case (seed, model, drafter, the actions) and shrunk
to the fewest actions that still part, each replay in a folder of its own as ``--replay``
runs one (a memory an earlier replay wrote would draft otherwise).
``tests/test_differential.py`` runs a fixed-seed slice in CI.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from engine.errors import ContextFullError, InvalidPromptError, InvalidSettingError, TandemError
from tests.differential_features import FEATURE_KINDS, feature_action
from training.spec_bench import DEV_PROMPTS

if TYPE_CHECKING:
    from app.conversation_store import ConversationStore
    from engine.conversation import AnswerService, Question

PROBE = "In one sentence, what did we just talk about?"
# A probe on the conversation the last probe saw (after a re-measure, a plan switch, an
# answer every session refused) asks the other question: the prompt reader would answer the
# same prompt again from its remembered logits, without reading a cell (a re-measure puts
# them back with the cells, so a bad restore went unseen).
PROBE_OTHER = "Which word of our chat mattered most?"
# Errors plain decoding raises on its own, whatever drafts: every session raising one is
# the same outcome (reported). Any other error every session raises parts (a failed decode).
REFUSALS = (ContextFullError, InvalidPromptError, InvalidSettingError)
CHAT_KINDS = ("new_chat", "follow_up", "regenerate", "edit", "stop", "long", "sampled",
              "short_limit", "replan", "switch_branch")
KINDS = (*CHAT_KINDS, *FEATURE_KINDS)
# Measuring the machine again between answers: only a planned session (``auto``) does.
PLANNED_KINDS = (*KINDS, "remeasure")


@dataclass
class Action:
    kind: str
    text: str = ""
    max_tokens: int = 24
    seed: int | None = None  # sampling at temperature 0.8 with this seed; None: greedy
    edit_at: int = 0  # for "edit": which user message (from the start) is replaced
    stop_after: int = 0  # for "stop": the answer stops after this many text pieces
    max_draft: int = 0  # for "replan": every drafted session's new draft budget
    # For the feature actions (tests/differential_features.py): "document": whole,
    # passages or raised (the size it is made for); "prediction": right, perturbed or
    # unrelated; "json_schema": the schema's name.
    mode: str = ""
    extra: str = ""  # "document": the document's text; "prediction": the unrelated text


@dataclass
class Divergence:
    action: int  # index of the action whose answer or probe parted
    drafter: str
    what: str


@dataclass
class Outcome:
    """One session's answer: its tokens, why it ended, its text as streamed and as
    returned, the drafter call that raised while answering ("" if none), or the error
    raised instead ("Type: message"; the rest then empty)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    streamed: str = ""
    text: str = ""
    drafter_failed_in: str = ""
    fallback: str = ""
    error: str = ""
    refused: bool = False  # the error is one of REFUSALS


class Asked(NamedTuple):
    """One question asked of every session: the first way they parted (None if none),
    plain's answer, and its text as the conversation keeps it (up to the stop)."""

    found: Divergence | None
    plain: Outcome
    text: str = ""


def _without_prediction(question: Question) -> Question:
    """``question`` as plain decoding answers it: no prediction to draft from."""
    if not question.generation.prediction:
        return question
    return replace(question, generation=replace(question.generation, prediction=""))


@dataclass
class Case:
    seed: int
    model: str
    drafters: list[str]
    n_ctx: int
    actions: list[Action] = field(default_factory=list)
    draft_model: str | None = None  # the GGUF the "draft" drafter runs
    flash_attn: bool | None = None  # None: the target's rule (off on this CPU)


def random_actions(rng: random.Random, prompts: list[dict], n: int,
                   kinds: tuple[str, ...] = KINDS) -> list[Action]:
    """``n`` actions a user (or the app between answers) could take, from the dev
    prompts' texts."""
    short = [r["turns"][0] for r in prompts if len(r["turns"][0]) < 400]
    long = [r["turns"][0] for r in prompts if r["category"] in ("rag", "summarization")]
    actions = [Action("new_chat", rng.choice(short), rng.randint(8, 32))]
    for _ in range(n - 1):
        kind = rng.choice(kinds)
        if kind in FEATURE_KINDS:
            actions.append(feature_action(rng, kind, short, long))
            continue
        text = rng.choice(long if kind == "long" else short)
        action = Action(kind, text, rng.randint(4, 32))
        if kind == "sampled":
            action.seed = rng.randint(0, 2**31 - 1)
        elif kind == "edit":
            action.edit_at = rng.randint(0, 3)
        elif kind == "stop":
            action.stop_after = rng.randint(1, 6)
        elif kind == "short_limit":
            action.max_tokens = rng.randint(1, 3)
        elif kind == "replan":
            action.max_draft = rng.randint(1, 8)
        actions.append(action)
    return actions


class Sessions:
    """One AnswerService per drafter ("none" first), on one model."""

    def __init__(self, model: Path, drafters: list[str], n_ctx: int, work: Path,
                 draft_model: Path | None = None, flash_attn: bool | None = None) -> None:
        self.names = ["none", *drafters]
        self._opening = (model, work, draft_model, flash_attn)
        self.services: dict[str, AnswerService] = {}
        self._open(n_ctx)
        # The largest context a document may raise it to (the window's ``max_ctx``).
        trained = self.services["none"].engine.model.header.context_length  # type: ignore[union-attr]
        self.max_ctx = min(2 * n_ctx, trained or 2 * n_ctx)
        self._store: ConversationStore | None = None  # documents' conversations (SQLite)
        self.messages: list[dict[str, str]] = []
        self.other_branch: list[dict[str, str]] | None = None  # what the last edit replaced
        self.n_actions = 0
        self.n_tokens = 0  # generated, all sessions together
        # Draft tokens kept and taken back per session: identical output is only worth
        # something where drafts were accepted and rejected.
        self.accepted = dict.fromkeys(self.names, 0)
        self.rejected = dict.fromkeys(self.names, 0)
        # Follow-ups and regenerates whose prompt was read again from (nearly) the start
        # although the last one's was cached: no path should re-read a conversation.
        self.rereads = dict.fromkeys(self.names, 0)
        self.n_continued = 0  # such actions, every session together
        self._last_prompt: dict[str, int] = {}
        # Errors every session raised alike ("action I (kind): Type: message").
        self.errors: list[str] = []
        # What the feature actions reached: "document whole", "document passages",
        # "context raised", "tool call read" (or "tool call cut"), "prediction right"...
        self.features: dict[str, int] = {}
        # The conversation and question the last probe asked about.
        self._last_probe: tuple[list[dict[str, str]], str] = ([], "")

    def _open(self, n_ctx: int) -> None:
        """Every session's engine at context ``n_ctx``."""
        from engine.conversation import AnswerService
        from engine.session import Engine, EngineConfig

        model, work, draft_model, flash_attn = self._opening
        self.n_ctx = n_ctx
        for name in self.names:
            config = EngineConfig(model_path=model, drafter=name, n_threads=2, n_ctx=n_ctx,
                                  cache_dir=work / "cache", memory_dir=work / f"mem-{name}",
                                  draft_model=draft_model, flash_attn=flash_attn)
            engine = Engine(config)
            # What is drafted, verified and parked must not follow this machine's timings
            # (the budget's cost curve, auto's governor, a head's dynamic depth), or a case
            # would not replay (qwen35 with MTP parted once, 8e-4, in a run beside other
            # work, and replayed clean).
            engine.pin_drafting(0.35)
            self.services[name] = AnswerService(engine, config)

    def reopen(self, n_ctx: int) -> None:
        """Every session reloaded with context ``n_ctx``, as the window reloads the model
        for documents that fit whole only in a larger one (the caches start empty; a
        memory stays on disk)."""
        for service in self.services.values():
            service.close()
        self.services = {}
        self._open(n_ctx)
        self._last_prompt.clear()

    def close(self) -> None:
        for service in self.services.values():
            service.close()
        if self._store is not None:
            self._store.close()
            self._store = None

    def run(self, action: Action) -> Divergence | None:
        """Apply ``action`` to every session; the first way they part, if any."""
        from engine.conversation import Question
        from engine.decoding.generation import GenerationConfig
        from engine.decoding.sampling import SamplingParams

        index, self.n_actions = self.n_actions, self.n_actions + 1
        if action.kind in ("replan", "remeasure"):
            self._between_answers(action)
            return self._probe(index)
        if action.kind == "switch_branch":  # back to the conversation before the last edit
            if self.other_branch is not None:
                self.messages, self.other_branch = self.other_branch, self.messages
                # The cache holds the other branch: the next prompt reads this one's
                # turns after the edit point, as any chat app must (not a re-read).
                self._last_prompt.clear()
            return self._probe(index)
        if action.kind in FEATURE_KINDS:
            return self._feature(index, action)
        messages = self._messages_for(action)
        sampling = (SamplingParams(temperature=0.8, seed=action.seed)
                    if action.seed is not None else SamplingParams())
        question = Question.chat(messages, GenerationConfig(action.max_tokens,
                                                            sampling=sampling))
        asked = self._ask(index, action, question)
        if asked.found is not None or asked.plain.error:
            return asked.found or self._probe(index)
        if action.kind == "edit":
            self.other_branch = self.messages
        elif action.kind == "new_chat":
            self.other_branch = None
        self.messages = messages + [{"role": "assistant", "content": asked.text}]
        return self._probe(index)

    def _ask(self, index: int, action: Action, question: Question,
             drafted: Callable[[Outcome], Question] | None = None, turn: str = "") -> Asked:
        """Every session's answer to ``question`` compared with plain's: the plain
        session answers it without a prediction (plain decoding), the others
        ``drafted(plain's answer)`` where given (a prediction made from it). ``turn``
        names the answer in a divergence (an action with two)."""
        plain = self._answer("none", self.services["none"], action,
                             _without_prediction(question))
        other = drafted(plain) if drafted is not None and not plain.error else question
        outcomes = {"none": plain, **{name: self._answer(name, self.services[name], action,
                                                         other)
                                      for name in self.names[1:]}}
        if plain.error:
            odd = [n for n in self.names[1:] if outcomes[n].error != plain.error]
            if odd:
                got = outcomes[odd[0]]
                return Asked(Divergence(index, odd[0], f"{turn}{got.error or 'an answer'} "
                                        f"where plain raised {plain.error}"), plain)
            return Asked(self._raised_alike(index, action, plain), plain)
        for name in self.names[1:]:
            got = outcomes[name]
            if got.error:
                return Asked(Divergence(index, name, f"{turn}{got.error} where plain "
                                        "answered"), plain)
            # The user still got the answer (plainly after the failure), but a crash the
            # drafter was not refused for at build time is a fault the check must show.
            if got.drafter_failed_in:
                return Asked(Divergence(index, name, f"{turn}the drafter failed in "
                                        f"{got.drafter_failed_in} while answering: "
                                        f"{got.fallback}"), plain)
        n_answer = len(plain.tokens)
        if action.kind == "stop":  # a drafted step stops at its end: compare the prefix
            n_answer = min(len(o.tokens) for o in outcomes.values())
            self._stopped_at(question, n_answer)
        self.n_tokens += n_answer * len(self.names)
        for name in self.names[1:]:
            why = _parts(action, plain, outcomes[name])
            if why:
                return Asked(Divergence(index, name, turn + why), plain)
        text = self.services["none"].engine.target.detokenize(plain.tokens[:n_answer])
        return Asked(None, plain, text)

    def _feature(self, index: int, action: Action) -> Divergence | None:
        """A feature action (tests/differential_features.py) after the conversation so
        far: its question (two for a tool round) asked of every session, then the probe."""
        from engine.conversation import Question
        from engine.decoding.generation import GenerationConfig
        from engine.tool_syntax import tool_syntax_of
        from tests import differential_features as features

        syntax = tool_syntax_of(self.services["none"].engine.target.template.source)  # type: ignore[union-attr]
        history = list(self.messages)
        if action.kind == "document":
            turn = features.DocumentTurn(self._documents(), history, action)
            grown = turn.grown_context(self.n_ctx, self.max_ctx)
            if grown is not None:
                self.reopen(grown)
                self._reached("context raised")
            user, whole = turn.user_message(self.n_ctx)
            self._reached("document whole" if whole else "document passages")
            messages = [*history, user]
            question = Question.chat(messages, GenerationConfig(
                action.max_tokens, sampling=features.chat_sampling(action)))
            asked = self._ask(index, action, question)
        elif action.kind == "tool_round":
            # A new chat with the tools offered (and offered on after it, as the window
            # offers them while they are on): offered in the middle of a chat, they
            # change its first message, and the whole chat would be read again.
            self.other_branch = None
            asked = self._ask(index, action,
                              features.tool_call_question([], action, syntax),
                              turn="the call: ")
            if asked.found is not None or asked.plain.error:
                return asked.found or self._probe(index)
            read = syntax.read(asked.text, list(features.TOOLS)) is not None
            self._reached("tool call read" if read else "tool call cut")
            turns = features.tool_result_turns([], action, syntax, asked.text)
            question = features.tool_result_question(turns, action, syntax)
            asked = self._ask(index, action, question, turn="after its result: ")
            messages = list(question.messages)
        else:  # the API's: a prediction, a JSON schema
            self._reached(f"{action.kind} {action.mode}")
            def request(prediction: str = "") -> Question:
                return features.api_question(history, action, self.n_ctx, syntax,
                                             prediction)

            def predicted(plain: Outcome) -> Question:
                return request(features.prediction_text(action, plain.text))

            asked = self._ask(index, action, request(),
                              predicted if action.kind == "prediction" else None)
            messages = [*history, {"role": "user", "content": action.text}]
        if asked.found is not None or asked.plain.error:
            return asked.found or self._probe(index)
        self.messages = messages + [{"role": "assistant", "content": asked.text}]
        return self._probe(index)

    def _reached(self, feature: str) -> None:
        self.features[feature] = self.features.get(feature, 0) + 1

    def _documents(self) -> ConversationStore:
        """The conversations database documents are attached in (opened once)."""
        if self._store is None:
            from tests.differential_features import open_store

            self._store = open_store(self._opening[1])
        return self._store

    def _answer(self, name: str, service: AnswerService, action: Action, question: Question
                ) -> Outcome:
        """``service``'s answer to ``question`` (stopped as ``action`` says), counted."""
        pieces: list[str] = []

        def stop() -> bool:
            return bool(action.stop_after) and len(pieces) >= action.stop_after

        target = service.engine.target
        read_again = target.n_read_again
        try:
            answer = service.answer(question, on_text=pieces.append, should_stop=stop)
        except TandemError as exc:  # the same refusal everywhere is the same outcome
            return Outcome(error=f"{type(exc).__name__}: {exc}",
                           refused=isinstance(exc, REFUSALS))
        result = answer.result
        # Cached tokens read again inside the target (recurrent state that could not go
        # back) were not reused.
        reused = result.stats.n_prompt_reused - (target.n_read_again - read_again)
        if not answer.n_dropped:  # (oldest turns dropped: mostly new text to read)
            self._count_rereads(name, action, answer.n_prompt, reused)
        steps = result.stats.steps
        self.accepted[name] += sum(s.n_accepted for s in steps)
        self.rejected[name] += sum(s.n_proposed - s.n_accepted for s in steps)
        return Outcome(result.tokens, result.finish_reason, "".join(pieces), result.text,
                       result.stats.drafter_failed_in, result.stats.fallback)

    def _raised_alike(self, index: int, action: Action | None, plain: Outcome
                      ) -> Divergence | None:
        """Every session raised ``plain.error``: reported, and a divergence unless it is a
        refusal plain decoding gives on its own (a decode that fails everywhere is a fault,
        not agreement)."""
        what = "the probe" if action is None else f"{action.kind}"
        self.errors.append(f"action {index} ({what}): {plain.error}")
        print(f"every session raised at action {index} ({what}): {plain.error}",
              file=sys.stderr, flush=True)
        if plain.refused:
            return None
        # A drafted session's name, so that the case replays with one beside plain.
        return Divergence(index, self.names[1], f"every session raised {plain.error}")

    def _between_answers(self, action: Action) -> None:
        """What the app does between answers: a plan switch (every drafted session's
        budget changed; a hybrid's snapshots follow it into a new context) or ``auto``
        measuring the machine again (the cache emptied and put back)."""
        from dataclasses import replace

        for service in self.services.values():
            engine = service.engine
            if action.kind == "remeasure":
                engine.remeasure()
            elif engine.drafter is not None:
                engine.apply(replace(engine.setup, max_draft=action.max_draft))

    def _count_rereads(self, name: str, action: Action, n_prompt: int, n_reused: int) -> None:
        last = self._last_prompt.get(name)
        self._last_prompt[name] = n_prompt
        if last is None or action.kind not in ("follow_up", "long", "regenerate"):
            return
        self.n_continued += 1
        if n_reused < min(last, n_prompt) // 2:
            self.rereads[name] += 1
            print(f"re-read at action {self.n_actions - 1} ({action.kind}, {name}): "
                  f"{n_reused} of {n_prompt} tokens reused, the last prompt {last}",
                  file=sys.stderr, flush=True)

    def _stopped_at(self, question: object, n_answer: int) -> None:
        """After a stop, every session as plain decoding leaves an answer stopped after
        ``n_answer`` tokens: the answer's tokens but its last in the cache. A drafted
        session stops at the end of a step, later than plain decoding; its extra cells
        (decoded in a verification) are not what plain decoding has, and the next prompt,
        which goes on from the common prefix, would read them instead of reading that
        token with the prompt's kernels (F32: 0.157 apart, seed 21)."""
        targets = [(s.engine.target, len(s.prompt_of(question)[0]) + n_answer - 1)  # type: ignore[arg-type]
                   for s in self.services.values()]
        if targets[0][0].arch.has_state and any(t.n_past > keep for t, keep in targets):
            # Recurrent state goes back only as far as its snapshots; further, it is read
            # again from the prompt's checkpoint, with other sums than one-token
            # decoding's. A user's stop never asks that of one session alone (its answer
            # keeps what it decoded), so every session's state is read again alike.
            for target, keep in targets:
                target.sequence.from_checkpoint(keep)
            return
        for target, keep in targets:
            if target.n_past > keep:
                target.rollback(keep)

    def _messages_for(self, action: Action) -> list[dict[str, str]]:
        user = {"role": "user", "content": action.text}
        if action.kind == "new_chat" or not self.messages:
            return [user]
        if action.kind == "regenerate":
            return self.messages[:-1]
        if action.kind == "edit":
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            cut = users[min(action.edit_at, len(users) - 1)]
            return self.messages[:cut] + [user]
        return self.messages + [user]

    def _probe(self, index: int) -> Divergence | None:
        """The first-token logits of a fixed next question, as the next answer's prefill
        reads them (with the features its drafter asks for): PROBE, or PROBE_OTHER where
        the last probe asked PROBE on the same conversation, so that the prefill reads the
        cached cells rather than remembered logits."""
        last_messages, last_question = self._last_probe
        question = PROBE
        if last_messages == self.messages and last_question == PROBE:
            question = PROBE_OTHER
        self._last_probe = (list(self.messages), question)
        logits: dict[str, np.ndarray] = {}
        errors: dict[str, Outcome] = {}
        for name, service in self.services.items():
            engine = service.engine
            prompt = engine.fit_chat(self.messages + [{"role": "user", "content": question}],
                                     8).tokens
            drafter = engine.drafter
            tail = drafter.prompt_features if drafter is not None else None
            if drafter is None:
                engine.target.set_features(False)
            try:
                logits[name] = engine.target.prefill(prompt, tail).logits.copy()
            except TandemError as exc:  # raised by one session and not another: parted
                errors[name] = Outcome(error=f"{type(exc).__name__}: {exc}",
                                       refused=isinstance(exc, REFUSALS))
        if errors:
            plain = errors.get("none", Outcome())
            odd = [n for n in self.names[1:] if errors.get(n, Outcome()).error != plain.error]
            if odd:
                return Divergence(index, odd[0], f"next prefill: "
                                  f"{errors.get(odd[0], Outcome()).error or 'logits':.60} "
                                  f"against plain's {plain.error or 'logits':.60}")
            return self._raised_alike(index, None, plain)
        for name in self.names[1:]:
            if not same_bytes(logits[name], logits["none"]):
                diff = float(np.max(np.abs(logits[name] - logits["none"])))
                return Divergence(index, name, f"next first-token logits {diff:.3g} apart"
                                  + (" (other bits: -0 and +0, or NaNs)" if diff == 0 else ""))
        return None


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit: ``np.array_equal`` takes -0 for +0 (and a NaN for no NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _parts(action: Action, plain: Outcome, got: Outcome) -> str:
    """How a drafted session's answer parts from plain's ("" where it does not)."""
    if action.kind == "stop" and "cancelled" in (plain.finish_reason, got.finish_reason):
        # Each stops at the end of a step (or a plain run): only the common prefix is
        # comparable, its text included only as tokens.
        n = min(len(plain.tokens), len(got.tokens))
        return "" if got.tokens[:n] == plain.tokens[:n] else \
            f"answer {got.tokens} parts from plain's {plain.tokens}"
    if got.tokens != plain.tokens:
        return f"answer {got.tokens} parts from plain's {plain.tokens}"
    if got.finish_reason != plain.finish_reason:
        return f"finished for {got.finish_reason!r} where plain did for {plain.finish_reason!r}"
    if got.streamed != plain.streamed:
        return f"streamed {got.streamed!r:.80} where plain streamed {plain.streamed!r:.80}"
    if got.text != plain.text:
        return f"text {got.text!r:.80} where plain's is {plain.text!r:.80}"
    return ""


@dataclass
class Replay:
    """What a case's replay gave: the divergence (None if none), the tokens generated,
    and each drafter's drafts accepted and rejected (a replay that drafted nothing proves
    nothing about drafting)."""

    found: Divergence | None
    tokens: int
    accepted: dict[str, int]
    rejected: dict[str, int]


def play(case: Case, work: Path) -> Replay:
    """Run ``case`` until it parts or ends."""
    sessions = Sessions(Path(case.model), case.drafters, case.n_ctx, work,
                        Path(case.draft_model) if case.draft_model else None,
                        case.flash_attn)
    found = None
    try:
        for action in case.actions:
            found = sessions.run(action)
            if found is not None:
                break
    finally:
        sessions.close()
    return Replay(found, sessions.n_tokens, dict(sessions.accepted), dict(sessions.rejected))


def shrink(case: Case, work: Path) -> Case:
    """The fewest actions (keeping order) that still part (``fewest_that_part``), each
    replay in a new, empty folder under ``work`` (as ``--replay`` starts): in the run's
    folder it would draft from the memory the run and earlier replays wrote, and a case
    shrunk so might not part again."""
    n_replays = 0

    def parts(trial: list[Action]) -> bool:
        nonlocal n_replays
        folder = work / f"replay-{n_replays}"
        n_replays += 1
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        try:
            return play(replace(case, actions=trial), folder).found is not None
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    return replace(case, actions=fewest_that_part(case.actions, parts))


def fewest_that_part(actions: list[Action], parts: Callable[[list[Action]], bool]
                     ) -> list[Action]:
    """Spans of ``actions`` dropped as long as the rest still ``parts``, halving the span
    down to one action; the first (it opens the chat) stays. A divergence found after
    hundreds of actions shrinks in about n log n replays of ever shorter cases, where
    dropping one action at a time replayed nearly the whole case n times."""
    actions = list(actions)
    span = max(1, (len(actions) - 1) // 2)
    while True:
        i = 1
        while i < len(actions):
            trial = actions[:i] + actions[i + span:]
            if parts(trial):
                actions = trial
            else:
                i += span
        if span == 1:
            return actions
        span //= 2


def run_for(seed: int, minutes: float, model: Path, drafters: list[str], n_ctx: int,
            prompts: list[dict], out: Path, work: Path, max_actions: int | None = None,
            first: list[Action] | None = None, draft_model: Path | None = None,
            flash_attn: bool | None = None,
            on_action: Callable[[Action, Divergence | None], None] | None = None) -> dict:
    """``first`` actions, then random ones for ``minutes`` (or until ``max_actions`` in
    all, whichever ends first); a divergence is shrunk and written to ``out``.
    ``on_action`` hears of each action as it ends (else a line on stderr says it). The
    result holds each kind's count and seconds (``seconds``: "document raised": [n, s],
    the probe after each action included)."""
    rng = random.Random(seed)
    kinds = PLANNED_KINDS if "auto" in drafters else KINDS
    deadline = time.monotonic() + minutes * 60
    sessions = Sessions(model, drafters, n_ctx, work, draft_model, flash_attn)
    done: list[Action] = []
    planned = list(first or [])
    result = {"seed": seed, "model": str(model), "drafters": drafters, "actions": 0,
              "tokens": 0, "divergences": 0, "cases": [], "wall_s": 0.0, "errors": [],
              "seconds": {}}
    t0 = time.monotonic()
    try:
        while time.monotonic() < deadline and (max_actions is None
                                                  or len(done) < max_actions):
            action = planned.pop(0) if planned else \
                random_actions(rng, prompts, 2, kinds)[1] if done else \
                random_actions(rng, prompts, 1)[0]
            done.append(action)
            t_action = time.monotonic()
            found = sessions.run(action)
            kind = f"{action.kind} {action.mode}" if action.mode else action.kind
            n, seconds = result["seconds"].get(kind, (0, 0.0))
            result["seconds"][kind] = [n + 1, round(seconds + time.monotonic() - t_action, 1)]
            result["actions"], result["tokens"] = len(done), sessions.n_tokens
            result["wall_s"] = round(time.monotonic() - t0, 1)
            result["accepted"], result["rejected"] = sessions.accepted, sessions.rejected
            result["rereads"], result["continued"] = sessions.rereads, sessions.n_continued
            result["errors"] = sessions.errors
            result["features"] = sessions.features
            if on_action is not None:
                on_action(action, found)
            else:
                print(f"{len(done)} {action.kind}: {'parted' if found else 'same'}",
                      file=sys.stderr, flush=True)
            if found is not None:
                result["divergences"] += 1
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"case-{seed}-{len(done)}.json"
                whole = Case(seed, str(model), [found.drafter], n_ctx, done,
                             str(draft_model) if draft_model else None, flash_attn)
                # Kept as found first: shrinking replays it many times.
                path.write_text(json.dumps({"divergence": asdict(found), **asdict(whole)},
                                           indent=1))
                sessions.close()
                case = shrink(whole, work)
                path.write_text(json.dumps({"divergence": asdict(found), **asdict(case)},
                                           indent=1))
                result["cases"].append(str(path))
                break
    finally:
        sessions.close()
    return result


def load_case(path: Path) -> Case:
    data = json.loads(path.read_text())
    return Case(data["seed"], data["model"], data["drafters"], data["n_ctx"],
                [Action(**a) for a in data["actions"]], data.get("draft_model"),
                data.get("flash_attn"))


class MatrixRow(NamedTuple):
    """A model and its drafters, run for ``share`` of the minutes. ``kind``: "bundled"
    is the bundled Q4_0, "q4_k_m" and "f32" its requantizations (F32 drafting with the
    bundled file as its draft model), any other a tiny synthetic file of that
    architecture (engine.gguf.architectures) whose layers add little to the residual
    stream, so the model often repeats itself and drafts are both kept and taken back.
    ``flash_attn``: forced on (trees, long prompts read in the F16 context and their
    cells moved in), as a GPU's target or one whose prompts read on a prefill copy runs;
    None: this CPU's rule (off, chains only, prompts read in the target's own cache;
    on for a sliding window)."""

    name: str
    kind: str
    drafters: list[str]
    share: float
    flash_attn: bool | None = None


# The real-size rows answer about 50 times slower than the tiny ones, so these get more
# of the time: more actions where they are cheap.
MATRIX = [
    MatrixRow("bundled", "bundled", ["auto", "memory", "head"], 1.0),
    MatrixRow("q4_k_m+eagle3", "q4_k_m", ["eagle3", "lookup"], 1.0),
    MatrixRow("f32+draft", "f32", ["draft", "lookup"], 0.75),
    MatrixRow("qwen35 hybrid", "qwen35", ["memory", "lookup", "mtp"], 1.5),
    MatrixRow("lfm2 hybrid", "lfm2", ["memory", "lookup"], 1.5),
    MatrixRow("gemma3 sliding window", "gemma3", ["memory", "lookup"], 1.5),
    MatrixRow("qwen3 with flash attention", "qwen3", ["memory", "lookup"], 1.5, True),
    MatrixRow("qwen3moe", "qwen3moe", ["memory", "lookup"], 1.5),
    MatrixRow("deepseek2 latent attention", "deepseek2", ["memory", "lookup", "mtp"], 1.5),
]


def matrix_model(kind: str, folder: Path) -> tuple[Path, Path | None]:
    """The model file for a MATRIX row (written once into ``folder``) and its draft
    model."""
    from engine.gguf.architectures import MTP_LAYOUTS, TinyShape, write_architecture_gguf
    from engine.hub.model_store import default_model_path

    bundled = default_model_path()
    if kind == "bundled":
        return bundled, None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind}.gguf"
    if kind in ("f32", "q4_k_m"):
        if not path.exists():
            from engine.hub.convert import quantize_as
            quantize_as(bundled, path, kind, 2)
        return path, bundled if kind == "f32" else None
    if not path.exists():
        shape = TinyShape(mtp_layers=1 if kind in MTP_LAYOUTS else 0, damp=0.22)
        write_architecture_gguf(kind, path, bundled, shape)
    return path, None


def run_matrix(seed: int, minutes: float, n_ctx: int, prompts: list[dict], out: Path,
               work: Path) -> dict:
    """Every MATRIX row for its share of ``minutes``; each row's counts are written
    to ``out/matrix-SEED.json`` when it ends, and a rerun skips the rows found there."""
    out.mkdir(parents=True, exist_ok=True)
    record = out / f"matrix-{seed}.json"
    rows = json.loads(record.read_text()) if record.exists() else {}
    shares = sum(row.share for row in MATRIX)
    for row in MATRIX:
        if row.name in rows:
            continue
        model, draft = matrix_model(row.kind, out / "models")
        print(f"== {row.name}: {', '.join(row.drafters)}", file=sys.stderr, flush=True)
        rows[row.name] = run_for(seed, minutes * row.share / shares, model, row.drafters,
                                 n_ctx, prompts, out, work / row.name.replace(" ", "-"),
                                 draft_model=draft, flash_attn=row.flash_attn)
        record.write_text(json.dumps(rows, indent=1))
    totals = {"actions": sum(r["actions"] for r in rows.values()),
              "tokens": sum(r["tokens"] for r in rows.values()),
              "divergences": sum(r["divergences"] for r in rows.values()),
              "wall_s": round(sum(r["wall_s"] for r in rows.values()), 1)}
    print(f"{'model':28} {'drafters':24} {'actions':>7} {'tokens':>7} {'parted':>6}  "
          "accepted/rejected")
    for name, r in rows.items():
        kept = ", ".join(f"{d} {r['accepted'][d]}/{r['rejected'][d]}" for d in r["drafters"])
        print(f"{name:28} {','.join(r['drafters']):24} {r['actions']:7} {r['tokens']:7} "
              f"{r['divergences']:6}  {kept}")
    print(f"{'all':53} {totals['actions']:7} {totals['tokens']:7} {totals['divergences']:6}")
    return {"rows": rows, **totals}


def segment_plan(n_actions: int, segment: int, rows: list[MatrixRow]
                 ) -> list[tuple[int, int, int]]:
    """(row index, segment index, actions) for ``n_actions`` shared among ``rows`` by
    their shares (largest remainders: the counts add up to ``n_actions``), each row's cut
    into segments of ``segment``; round-robin over the rows, so that a run cut short has
    reached every row."""
    total = sum(row.share for row in rows)
    exact = [n_actions * row.share / total for row in rows]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(rows)), key=lambda r: counts[r] - exact[r])
    for r in by_remainder[:n_actions - sum(counts)]:
        counts[r] += 1
    per_row = [[min(segment, n - start) for start in range(0, n, segment)] for n in counts]
    return [(r, i, sizes[i]) for i in range(max(map(len, per_row), default=0))
            for r, sizes in enumerate(per_row) if i < len(sizes)]


def run_matrix_actions(seed: int, n_actions: int, segment: int, n_ctx: int,
                       prompts: list[dict], out: Path, work: Path,
                       rows: list[MatrixRow] | None = None, minutes: float | None = None,
                       progress: bool = True) -> dict:
    """``n_actions`` over ``rows`` (MATRIX), in segments of ``segment`` actions (each a
    fresh set of sessions on a seed of its own: a divergence's case is at most one
    segment long), with a progress bar. Each segment's counts go to
    ``out/matrix-actions-SEED.json`` as it ends; a rerun skips the segments found there
    (asking for more actions goes on after them). ``minutes``: no segment starts after
    that long (the rest are left for a rerun)."""
    from tqdm import tqdm

    rows = list(MATRIX if rows is None else rows)
    out.mkdir(parents=True, exist_ok=True)
    record = out / f"matrix-actions-{seed}.json"
    state = json.loads(record.read_text()) if record.exists() else {
        "seed": seed, "segment": segment, "n_ctx": n_ctx, "segments": {}}
    if (state["segment"], state["n_ctx"]) != (segment, n_ctx):
        raise SystemExit(f"{record} was run with --segment {state['segment']} and --ctx "
                         f"{state['n_ctx']}: resume with those, or use another --seed")
    done: dict[str, dict[str, dict]] = state["segments"]
    plan = segment_plan(n_actions, segment, rows)
    deadline = time.monotonic() + minutes * 60 if minutes is not None else None
    finished = sum(size for r, i, size in plan if str(i) in done.get(rows[r].name, {}))
    bar = tqdm(total=n_actions, initial=finished, unit="action", file=sys.stderr,
               dynamic_ncols=True, disable=not progress)
    shared_cache = work / "machine-cache"  # this machine's measurements, made once
    shared_cache.mkdir(parents=True, exist_ok=True)
    n_parted = sum(r["divergences"] for row in done.values() for r in row.values())
    try:
        for r, i, size in plan:
            row = rows[r]
            if str(i) in done.get(row.name, {}):
                continue
            if deadline is not None and time.monotonic() > deadline:
                break
            model, draft = matrix_model(row.kind, out / "models")
            folder = work / f"{row.name.replace(' ', '-')}-{i}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            (folder / "cache").symlink_to(shared_cache.resolve(), target_is_directory=True)
            bar.set_description(f"{row.name} #{i}")
            bar.set_postfix(parted=n_parted)

            def heard(action: Action, found: Divergence | None, where: str = f"{row.name} "
                      f"#{i}") -> None:
                bar.update(1)
                if found is not None:
                    bar.write(f"{where}: {action.kind} parted: {found.what:.120}")

            result = run_for(seed * 1_000_000 + r * 10_000 + i, float("inf"), model,
                             row.drafters, n_ctx, prompts, out, folder, max_actions=size,
                             draft_model=draft, flash_attn=row.flash_attn, on_action=heard)
            bar.update(size - result["actions"])  # the rest of a segment that parted
            n_parted += result["divergences"]
            done.setdefault(row.name, {})[str(i)] = result
            shutil.rmtree(folder, ignore_errors=True)
            partial = record.with_suffix(".json.part")
            partial.write_text(json.dumps(state, indent=1))
            partial.replace(record)  # whole or not at all, if the run is killed here
    finally:
        bar.close()
    return matrix_actions_summary(state, n_actions)


def matrix_actions_summary(state: dict, n_actions: int) -> dict:
    """A ``run_matrix_actions`` record's totals: actions, tokens, divergences, cases, each
    kind's count and mean seconds, what the features reached, and each row's drafts
    kept and taken back."""
    results = [r for row in state["segments"].values() for r in row.values()]
    seconds: dict[str, list[float]] = {}
    reached: dict[str, int] = {}
    for r in results:
        for kind, (n, s) in r.get("seconds", {}).items():
            seconds.setdefault(kind, [0, 0.0])
            seconds[kind][0] += n
            seconds[kind][1] += s
        for feature, n in r.get("features", {}).items():
            reached[feature] = reached.get(feature, 0) + n
    rows = {}
    for name, segments in state["segments"].items():
        drafts = {}
        for r in segments.values():
            for d in r["drafters"]:
                kept, back = drafts.get(d, (0, 0))
                drafts[d] = (kept + r.get("accepted", {}).get(d, 0),
                             back + r.get("rejected", {}).get(d, 0))
        rows[name] = {"segments": len(segments),
                      "actions": sum(r["actions"] for r in segments.values()),
                      "divergences": sum(r["divergences"] for r in segments.values()),
                      "accepted/rejected": {d: f"{a}/{b}" for d, (a, b) in drafts.items()}}
    return {"asked": n_actions, "actions": sum(r["actions"] for r in results),
            "tokens": sum(r["tokens"] for r in results),
            "divergences": sum(r["divergences"] for r in results),
            "cases": [c for r in results for c in r["cases"]],
            "errors": [e for r in results for e in r["errors"]],
            "wall_s": round(sum(r["wall_s"] for r in results), 1),
            "mean_s": {k: round(s / n, 1) for k, (n, s) in sorted(seconds.items())},
            "features": dict(sorted(reached.items())), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from engine.hub.model_store import default_model_path

    p = argparse.ArgumentParser(prog="python -m tests.differential", description=__doc__)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--minutes", type=float, default=None,
                   help="how long to run (default 5; with --actions: no limit, and no "
                        "segment starts after it)")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: bundled)")
    p.add_argument("--drafters", default="memory,lookup,head,eagle3")
    p.add_argument("--ctx", type=int, default=1024, help="small: long chats shift")
    p.add_argument("--prompts", type=Path, default=DEV_PROMPTS)
    p.add_argument("--out", type=Path, default=Path("differential-cases"))
    p.add_argument("--replay", type=Path, default=None, help="a case file to run again")
    p.add_argument("--draft-model", type=Path, default=None,
                   help="the GGUF the 'draft' drafter runs")
    p.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto",
                   help="the target's flash attention (auto: this CPU's rule)")
    p.add_argument("--matrix", action="store_true",
                   help="every MATRIX model and drafter, sharing the minutes")
    p.add_argument("--actions", type=int, default=None,
                   help="with --matrix: this many actions, shared as the minutes are, in "
                        "segments that a rerun resumes after (matrix-actions-SEED.json)")
    p.add_argument("--segment", type=int, default=50,
                   help="actions in each segment of --actions (fresh sessions each)")
    args = p.parse_args(argv)
    if args.actions is not None and not args.matrix:
        p.error("--actions runs over the matrix: give --matrix too")
    minutes = 5.0 if args.minutes is None else args.minutes
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay is not None:
            case = load_case(args.replay)
            if args.model is not None:  # a case file names the model it was found on
                case = replace(case, model=str(args.model))
            found = play(case, Path(tmp)).found
            print(json.dumps(asdict(found) if found else "no divergence"))
            return 1 if found else 0
        prompts = [json.loads(line) for line in args.prompts.read_text().splitlines()
                   if line.strip()]
        if args.actions is not None:
            summary = run_matrix_actions(args.seed, args.actions, args.segment, args.ctx,
                                         prompts, args.out, Path(tmp), minutes=args.minutes)
            print(json.dumps(summary, indent=1))
            return 1 if summary["divergences"] else 0
        if args.matrix:
            result = run_matrix(args.seed, minutes, args.ctx, prompts, args.out, Path(tmp))
            print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
            return 1 if result["divergences"] else 0
        result = run_for(args.seed, minutes, args.model or default_model_path(),
                         args.drafters.split(","), args.ctx, prompts, args.out, Path(tmp),
                         draft_model=args.draft_model,
                         flash_attn={"auto": None, "on": True, "off": False}[args.flash_attn])
    print(json.dumps(result, indent=1))
    return 1 if result["divergences"] else 0


if __name__ == "__main__":
    sys.exit(main())
