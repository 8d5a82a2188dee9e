"""The one way a front end answers: the CLI's chat and generate, the window's worker and
the API's lane all ask an ``AnswerService`` (the bench drives ``Engine.generate`` itself,
to time each drafter on the same prompt tokens).

It holds the engine (in this process, or in a child when the target runs on workers),
and for each ``Question``: fits the conversation into the context (or tokenizes a text
to continue), refuses a prompt that cannot fit before anything streams, generates, and
says what went wrong as one ``Failure`` every front end words its own way. After a lost
worker it opens the same model on this machine where it fits (``recover``).
docs/engine.md follows one message through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from engine.decoding.generation import GenerationConfig, GenerationResult
from engine.decoding.logprobs import TokenLogprob
from engine.decoding.stats import StepStats
from engine.errors import (
    ContextFullError,
    InvalidSamplingError,
    TandemError,
    WorkerError,
    WorkerLostError,
)
from engine.runtime.context_fit import DEFAULT_POLICY
from engine.session import Engine, EngineConfig
from engine.session_process import EngineProcess, check_fits_here, open_engine

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
LOCAL_AGAIN = "the worker was lost: the model now runs on this machine"
T = TypeVar("T")


@dataclass(frozen=True)
class Question:
    """What to answer: a conversation (``messages``, system prompt first) or, when
    ``text`` is given, that text to continue as it is (a completion)."""

    messages: tuple[dict[str, Any], ...] = ()
    text: str | None = None
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    context_policy: str = DEFAULT_POLICY  # engine.runtime.context_fit
    thinking: bool | None = None  # for templates with a thinking switch; None: theirs
    special: bool = False  # a text's control tokens (<|im_start|>...) parsed as such
    # Functions offered through the chat template's own syntax (engine.tool_syntax)
    tools: tuple[dict, ...] = ()

    @classmethod
    def chat(cls, messages: list[dict[str, Any]], generation: GenerationConfig,
             context_policy: str = DEFAULT_POLICY, thinking: bool | None = None,
             tools: tuple[dict, ...] = ()) -> Question:
        return cls(tuple(messages), None, generation, context_policy, thinking,
                   tools=tools)

    @classmethod
    def completion(cls, text: str, generation: GenerationConfig, special: bool = False
                   ) -> Question:
        return cls((), text, generation, special=special)


@dataclass(frozen=True)
class Answer:
    result: GenerationResult
    n_prompt: int  # tokens the prompt had
    n_dropped: int = 0  # oldest messages left out to fit the context


@dataclass(frozen=True)
class Failure:
    """What went wrong with an answer or a load, in words, and of which kind:
    "context" (the prompt does not fit), "sampling" (a bad setting), "worker_lost" (the
    worker running the target stopped; the next answer runs here if the model fits),
    "worker" (a worker refused), "engine" (any other engine error), "internal" (a bug)."""

    kind: str
    message: str


def failure_of(exc: BaseException) -> Failure:
    """The one mapping from an exception to what the user is told."""
    if isinstance(exc, ContextFullError):
        return Failure("context", str(exc))
    if isinstance(exc, InvalidSamplingError):
        return Failure("sampling", str(exc))
    if isinstance(exc, WorkerLostError):
        return Failure("worker_lost", str(exc))
    if isinstance(exc, WorkerError):
        return Failure("worker", str(exc))
    if isinstance(exc, TandemError):
        return Failure("engine", str(exc))
    log.error("answering failed", exc_info=exc)
    return Failure("internal", f"{type(exc).__name__}: {exc}")


class Generates(Protocol):
    """What decodes an answer after its prompt: ``Engine.generate``'s call."""

    def __call__(self, prompt: list[int], config: GenerationConfig | None = None, *,
                 on_text: Callable[[str], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 plain: bool = False,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
                 ) -> GenerationResult: ...


class RunsThere(Protocol):
    """Runs ``fn`` where the engine's llama.cpp calls must run, and waits: its result or
    its exception."""

    def __call__(self, fn: Callable[[], T], /) -> T: ...


def _here(fn: Callable[[], T]) -> T:
    return fn()


@dataclass(frozen=True)
class Elsewhere:
    """Where an answer is decoded other than by the engine's own ``generate`` on this
    thread: a parallel lane (app.server.parallel_lane). ``run`` runs the engine's own
    work (the prompt, the grammar's check) on the engine's thread; ``generate`` decodes
    the answer."""

    run: RunsThere
    generate: Generates


class AnswerService:
    """An engine and the way to answer with it. ``engine`` is None only after a lost
    worker whose model does not fit here. A context manager; ``close()`` is idempotent."""

    def __init__(self, engine: Engine | EngineProcess, config: EngineConfig,
                 on_note: Progress | None = None, auto_recover: bool = True) -> None:
        """``auto_recover`` False: a lost worker's model reopens only when ``recover`` is
        called (the window does, to show the load and the note), never inside an
        answer."""
        self.engine: Engine | EngineProcess | None = engine
        self.config = config  # what was asked: a reopened engine keeps its workers' wish
        self._on_note = on_note or (lambda _note: None)
        self._auto_recover = auto_recover
        self.lost_note = ""  # said while the model runs here because its worker was lost
        self.why_not_here = ""  # why a lost worker's model could not open here

    @classmethod
    def open(cls, config: EngineConfig, progress: Progress | None = None,
             on_note: Progress | None = None, auto_recover: bool = True) -> AnswerService:
        """The engine ``config`` asks for (in a child process when it uses workers).
        Raises what ``Engine`` raises."""
        return cls(open_engine(config, progress), config, on_note, auto_recover)

    # --- the engine, and its recovery ------------------------------------------------------
    def current(self) -> Engine | EngineProcess | None:
        """The engine to answer with: a lost worker's is replaced here first (unless
        recovery is left to the caller)."""
        if self._auto_recover:
            self.recover()
        return self.engine

    def recover(self, progress: Progress | None = None) -> bool:
        """After a lost worker: the same model and drafter opened on this machine where it
        fits (the note says so), else no engine and the reason as a note. Returns whether
        an engine was lost."""
        engine = self.engine
        if not isinstance(engine, EngineProcess) or engine.alive:
            return False
        engine.close()
        self.engine = None
        try:
            check_fits_here(self.config)
            self.engine = open_engine(replace(self.config, workers=()), progress)
        except TandemError as exc:
            self.why_not_here = str(exc)
            self._on_note(self.why_not_here)
            return True
        self.lost_note = LOCAL_AGAIN
        self._on_note(LOCAL_AGAIN)
        return True

    # --- answering -----------------------------------------------------------------------
    def prompt_of(self, question: Question) -> tuple[list[int], int]:
        """The prompt's tokens and how many of the oldest messages were left out."""
        engine = self._engine()
        if question.text is not None:
            return engine.target.tokenize(question.text or "", special=question.special), 0
        thinking = question.thinking if engine.target.template.thinking_switch else None
        fitted = engine.fit_chat(list(question.messages), question.generation.max_tokens,
                                 question.context_policy, thinking,
                                 list(question.tools) or None)
        return fitted.tokens, fitted.n_dropped

    def answer(self, question: Question, *,
               on_start: Callable[[int, int], None] | None = None,
               on_text: Callable[[str], None] | None = None,
               on_step: Callable[[StepStats], None] | None = None,
               should_stop: Callable[[], bool] | None = None,
               plain: bool = False,
               on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
               elsewhere: Elsewhere | None = None) -> Answer:
        """Answer ``question``. ``on_start(prompt tokens, dropped messages)`` comes once
        the prompt fits, before any text. Raises ContextFullError (nothing generated),
        WorkerLostError (the next call runs here where the model fits), and what
        ``Engine.generate`` raises. ``elsewhere``: decoded there (a parallel lane) after
        the same prompt and checks."""
        engine = self._engine()
        run: RunsThere = _here
        generate: Generates = engine.generate
        if elsewhere is not None:
            run, generate = elsewhere.run, elsewhere.generate
        prompt, n_dropped = run(lambda: self.prompt_of(question))
        if len(prompt) + 1 > engine.target.n_ctx:  # before a client sees a first byte
            raise ContextFullError(len(prompt) + 1, engine.target.n_ctx)
        grammar = question.generation.grammar
        if grammar:  # so is a grammar llama.cpp cannot parse
            run(lambda: engine.check_grammar(grammar))
        if on_start is not None:
            on_start(len(prompt), n_dropped)
        result = generate(prompt, question.generation, on_text=on_text, on_step=on_step,
                          should_stop=should_stop, plain=plain, on_logprobs=on_logprobs)
        return Answer(result, len(prompt), n_dropped)

    def _engine(self) -> Engine | EngineProcess:
        engine = self.current()
        if engine is None:
            raise TandemError("no model is loaded")
        return engine

    # --- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def __enter__(self) -> AnswerService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
