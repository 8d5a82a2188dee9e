"""OpenAI-compatible routes over an EngineLane, on Starlette (served by uvicorn).

``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``; streaming as
server-sent events ending in ``data: [DONE]``. Every answer carries Tandem's own figures
in an extra ``tandem`` field. Errors use OpenAI's shape and never stop the server.

Tool calls follow OpenAI's rules: a named ``tool_choice`` or ``parallel_tool_calls: false``
is one call (held by the grammar where a call is required; with ``auto`` the calls read
back are cut to the first). An answer cut short inside a call (``max_tokens``, a stop
string) keeps its finish reason (``length``) and carries no ``tool_calls``: the unfinished
call is dropped, not sent as content nor as arguments that do not parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.server.lane import EngineLane, Job
from app.server.logprobs_format import chat_logprobs, text_logprobs
from app.server.schema import ApiError, CompletionRequest, Limits, parse_request
from engine.conversation import AnswerService
from engine.decoding.generation import GenerationResult
from engine.decoding.logprobs import TokenLogprob
from engine.planning.prediction_budget import exactness_figures
from engine.session import Engine
from engine.session_process import EngineProcess
from engine.tool_calls import ToolCall
from engine.tool_syntax import GENERIC, ToolSyntax, tool_syntax_of

# While a request waits for the model, how often to look for a client that left.
_DISCONNECT_POLL_S = 0.25
# Bodies over the limit are still read (and dropped) up to this size before the 413.
_DRAIN_LIMIT = 64 << 20
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
           "cancelled": "stop"}


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


@dataclass(frozen=True)
class _Message:
    """A chat answer as OpenAI's message: its text (None: none) and calls (none: no
    ``tool_calls``), and its finish reason."""

    content: str | None
    calls: list[ToolCall]
    finish: str


@dataclass
class ServerState:
    lane: EngineLane
    service_of: Callable[[], AnswerService | None]
    limits: Limits
    api_key: str | None = None

    def engine_of(self) -> Engine | EngineProcess | None:
        service = self.service_of()
        return service.engine if service is not None else None

    def tool_syntax(self) -> ToolSyntax:
        """How the loaded model's chat template offers functions."""
        engine = self.engine_of()
        return tool_syntax_of(engine.target.template.source) if engine is not None \
            else GENERIC

    def request_limits(self) -> Limits:
        """The limits a request is checked against, with the loaded model's context."""
        engine = self.engine_of()
        return replace(self.limits, n_ctx=engine.target.n_ctx) if engine is not None \
            else self.limits

    def model_id(self) -> str:
        engine = self.engine_of()
        return engine.model.path.stem if engine is not None else "none"

    def figures(self, result: GenerationResult, job: Job) -> dict[str, Any]:
        """Tandem's numbers for one answer (the ``tandem`` field)."""
        s = result.stats
        engine = self.engine_of()
        plan = engine.plan if engine is not None else None
        return {"tokens_per_second": round(s.tok_per_s, 2),
                "time_to_first_token_s": round(s.ttft_s, 4),
                "tokens_per_verification": round(s.mean_accepted, 3),
                "drafter": s.drafter,
                "layout": plan.layout_text() if plan is not None else "plain",
                "prompt_tokens_reused": s.n_prompt_reused,
                "guarantee": engine.guarantee if engine is not None else "",
                # exact: this answer is plain decoding's by construction (else a warning)
                **exactness_figures(s.drafter, engine is None or engine.verifies_exactly),
                "queue_wait_s": round(job.queue_wait_s, 4),
                "finish_reason": result.finish_reason}


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _usage(result: GenerationResult) -> dict[str, Any]:
    """OpenAI's usage; with a prediction, how many of its tokens the model verified and
    kept or turned down (completion_tokens_details, as OpenAI reports them)."""
    stats = result.stats
    n_prompt, n_new = stats.n_prompt, stats.n_new
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new,
            "total_tokens": n_prompt + n_new,
            "completion_tokens_details": {
                "accepted_prediction_tokens": stats.n_prediction_accepted,
                "rejected_prediction_tokens": stats.n_prediction_rejected}}


def _check_key(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             state.api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' "
                            "with the key given to tandem serve --api-key",
                       code="invalid_api_key", kind="authentication_error")


async def _read_json(request: Request, limit: int) -> Any:
    too_large = ApiError(413, f"the request body is larger than {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > _DRAIN_LIMIT:
        raise too_large  # not worth reading: the connection closes after the answer
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:  # read to the end, so the client gets the answer, not a reset
        raise too_large
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})",
                       code="invalid_json") from None


async def _next_event(events: asyncio.Queue, request: Request, job: Job) -> tuple[str, Any]:
    """The job's next event; a client that leaves meanwhile cancels the job."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                raise ClientGone from None


def _deliver_to(loop: asyncio.AbstractEventLoop, events: asyncio.Queue
                ) -> Callable[[str, object], None]:
    """An ``emit`` for the lane's thread that hands events to this request's loop."""
    def emit(kind: str, value: object) -> None:
        # A closed loop means the server stopped and nobody listens.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))
    return emit


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Answer:
    """The response bodies of one request, chat or text, whole or in chunks."""

    def __init__(self, state: ServerState, req: CompletionRequest) -> None:
        self.state, self.req = state, req
        self.id = f"{'chatcmpl' if req.is_chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = state.model_id()
        # Log probabilities sent with streamed text so far (the finish chunk has the rest),
        # and the characters of their tokens (where a completion's next offsets start).
        self._n_logprobs_streamed = 0
        self._streamed_chars = 0

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.req.is_chat else "text_completion") + \
            (".chunk" if chunk and self.req.is_chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, chunk: bool,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.req.is_chat:
            return {"index": 0, "text": text or "", "logprobs": logprobs,
                    "finish_reason": finish}
        if chunk:
            return {"index": 0, "delta": {} if text is None else {"content": text},
                    "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, result: GenerationResult) -> dict[str, Any] | None:
        """The answer's log probabilities; in a stream, those no chunk carried yet."""
        if result.logprobs is None:
            return None
        rest = result.logprobs[self._n_logprobs_streamed:]
        if not rest and self._n_logprobs_streamed:
            return None
        return self._format(rest)

    def _format(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        if self.req.is_chat:
            return chat_logprobs(logprobs)
        return text_logprobs(logprobs, self._streamed_chars)

    def _message(self, result: GenerationResult) -> _Message:
        """The answer's text, or where tools were offered the calls it makes: at most one
        where parallel calls are off; none, and not its text either, where it was cut
        short inside a call."""
        text, finish = result.text, _FINISH[result.finish_reason]
        if not self.req.tools:
            return _Message(text, [], finish)
        syntax = self.req.tool_syntax
        read = syntax.read(text, list(self.req.tools))
        if read is not None:
            calls = read.calls if self.req.parallel_tool_calls else read.calls[:1]
            return _Message(read.content, calls, "tool_calls")
        start = syntax.call_start(text) if result.finish_reason != "eos" else None
        if start is not None:
            return _Message(text[:start].strip() or None, [], finish)
        return _Message(text, [], finish)

    @staticmethod
    def _openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in calls]

    def whole(self, result: GenerationResult, job: Job) -> dict[str, Any]:
        message = self._message(result)
        choice = self._choice(message.content, message.finish, False, self._logprobs(result))
        if message.calls:
            choice["message"]["tool_calls"] = self._openai_calls(message.calls)
        return {**self._envelope(False), "choices": [choice],
                "usage": _usage(result), "tandem": self.state.figures(result, job)}

    def _held_back(self, message: _Message) -> list[dict[str, Any]]:
        """Where tools were offered the text is held back while it is written (it may be a
        call): then sent as calls (after any text the model wrote before them) or as
        content, before the finish chunk."""
        before = [self.text_chunk(message.content)] if message.content else []
        if not message.calls:
            return before
        delta = {"tool_calls": [{"index": i, **c}
                                for i, c in enumerate(self._openai_calls(message.calls))]}
        return [*before, {**self._envelope(True),
                          "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": None}]}]

    def first_chunk(self) -> dict[str, Any]:
        choice = self._choice("", None, True)
        if self.req.is_chat:
            choice["delta"] = {"role": "assistant", "content": ""}
        return {**self._envelope(True), "choices": [choice]}

    def text_chunk(self, text: str, logprobs: list[TokenLogprob] | None = None
                   ) -> dict[str, Any]:
        """A chunk of text, with the log probabilities of the tokens it ends."""
        formatted = self._format(logprobs) if logprobs else None
        if logprobs:
            self._n_logprobs_streamed += len(logprobs)
            self._streamed_chars += sum(len(t.piece.decode("utf-8", errors="replace"))
                                        for t in logprobs)
        return {**self._envelope(True), "choices": [self._choice(text, None, True,
                                                                  formatted)]}

    def last_chunks(self, result: GenerationResult, job: Job) -> list[dict[str, Any]]:
        """Where tools were offered, the held-back text (as calls or as content); the
        finish chunk (with usage, Tandem's figures and, where asked for, the whole
        answer's log probabilities); OpenAI's separate usage chunk when the client asked
        for it (``stream_options.include_usage``)."""
        message = self._message(result)
        held = self._held_back(message) if self.req.tools else []
        choice = self._choice(None, message.finish, True, self._logprobs(result))
        finish = {**self._envelope(True), "choices": [choice],
                  "usage": _usage(result), "tandem": self.state.figures(result, job)}
        if not self.req.include_usage:
            return [*held, finish]
        return [*held, finish, {**self._envelope(True), "choices": [], "usage": _usage(result)}]


def make_app(state: ServerState) -> Starlette:
    async def models(request: Request) -> Response:
        try:
            _check_key(request, state)
        except ApiError as exc:
            return _error(exc)
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_id(), "object": "model", "created": 0, "owned_by": "tandem"}]})

    async def complete(request: Request, chat: bool) -> Response:
        try:
            _check_key(request, state)
            limits = state.request_limits()
            req = parse_request(await _read_json(request, limits.max_body_bytes),
                                limits, chat, state.tool_syntax())
            events: asyncio.Queue = asyncio.Queue()
            job = Job(req, _deliver_to(asyncio.get_running_loop(), events))
            state.lane.submit(job)
            kind, value = await _next_event(events, request, job)
            if kind == "error":
                raise value
        except ApiError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)
        answer = _Answer(state, req)
        if req.stream:
            return StreamingResponse(_stream(answer, events, job),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while True:  # a whole answer: no text events, only the result
                kind, value = await _next_event(events, request, job)
                if kind == "error":
                    return _error(value)
                if kind == "done":
                    return JSONResponse(answer.whole(value, job))
        except ClientGone:
            return Response(status_code=499)

    async def _stream(answer: _Answer, events: asyncio.Queue, job: Job) -> AsyncIterator[str]:
        try:
            yield _sse(answer.first_chunk())
            logprobs: list[TokenLogprob] = []  # for the next text chunk
            while True:
                kind, value = await events.get()
                if kind == "logprobs":
                    logprobs.extend(value)
                elif kind == "text":
                    if not answer.req.tools:  # (with tools all waits for the end)
                        yield _sse(answer.text_chunk(value, logprobs))
                        logprobs = []
                elif kind == "error":  # after the 200: the error travels as an event
                    yield _sse(value.body())
                    break
                elif kind == "done":
                    for chunk in answer.last_chunks(value, job):
                        yield _sse(chunk)
                    break
            yield _sse("[DONE]")
        finally:
            job.cancelled.set()  # a client that left stops its generation at the next step

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "waiting": state.lane.n_waiting,
                             **state.lane.counts})

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ], exception_handlers={404: _not_found, 405: _not_allowed})


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(ApiError(404, f"no route {request.url.path}; Tandem serves /v1/models, "
                                "/v1/chat/completions and /v1/completions", code="not_found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed"))
