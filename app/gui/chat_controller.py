"""What the chat buttons do: store writes, transcript updates and engine requests.

The controller lives in the GUI thread. It never calls the engine: it emits requests the
worker receives in its own thread, and handles the worker's signals. The answer being
written is saved as it streams (at most every ``save_interval_s`` or ``save_every``
tokens, one transaction each) with status ``streaming``, so a killed app leaves it in
the database, marked interrupted on the next start.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.conversation_store import (
    COMPLETE,
    FAILED,
    STOPPED,
    STREAMING,
    Attachment,
    ChatSettings,
    Conversation,
    ConversationStore,
    Message,
)
from app.documents.edit_prediction import edit_prediction
from app.documents.reading import Document, DocumentError, document_from_text
from app.gui.document_loader import DocumentLoader, paste_name
from app.gui.document_turn import (
    compose_user_turn,
    context_for_documents,
    model_text,
    searched_again,
)
from app.gui.engine_worker import (
    Comparison,
    EngineFailure,
    EngineWorker,
    GenerationOutcome,
    GenerationRequest,
)
from app.gui.loop_monitor import LoopLagMonitor
from app.gui.tool_loop import ToolLoop
from app.gui.tool_servers import ToolServers
from app.gui.transcript_model import TranscriptModel
from app.tools.turns import calls_of, expand
from engine.decoding.json_grammar import json_object_grammar, json_schema_text_grammar
from engine.decoding.sampling import SamplingParams
from engine.decoding.stats import GenerationStats
from engine.drafters.kinds import is_plain
from engine.errors import InvalidSamplingError

TITLE_CHARS = 48


def answer_grammar(settings: ChatSettings) -> str | None:
    """The grammar a chat's "Answer as JSON" asks for: any JSON object, or one matching
    the chat's schema. Raises InvalidSamplingError naming what is wrong with the schema."""
    if not settings.answer_json:
        return None
    if not settings.json_schema.strip():
        return json_object_grammar()
    return json_schema_text_grammar(settings.json_schema, "JSON schema")


@dataclass
class _Active:
    """The request the worker is running."""

    request_id: int
    kind: str  # "answer" or "compare"
    conversation_id: int
    message: Message | None = None  # the assistant message being written
    content: str = ""
    t_saved: float = 0.0
    n_unsaved: int = 0
    tool_limit: int = 0  # the loop's limit, when this answer was offered no tools for it


def summary_line(stats: GenerationStats, finish_reason: str) -> str:
    """The speed line under an answer."""
    line = (f"{stats.n_new} tokens · {stats.tok_per_s:.1f} tok/s · first token "
            f"{stats.ttft_s * 1000:.0f} ms")
    if not is_plain(stats.drafter):
        line += f" · {stats.drafter}: {stats.mean_accepted:.2f} tokens per verification"
    extra = {"length": "max tokens reached", "context": "context full"}.get(finish_reason)
    return f"{line} · {extra}" if extra else line


class ChatController(QObject):
    generate_request = Signal(object)  # GenerationRequest, to the worker
    compare_request = Signal(object)  # GenerationRequest, to the worker
    busy_changed = Signal(bool)
    conversations_changed = Signal()
    conversation_opened = Signal(int)
    started = Signal(int, str)  # request id, kind
    answer_finished = Signal(object)  # GenerationOutcome (after the store is updated)
    comparison_finished = Signal(object)  # Comparison
    problem = Signal(str)  # something to tell the user
    attachments_changed = Signal(object)  # list[Document]: what the next message takes
    reading_changed = Signal(object)  # list[str]: files still being read
    context_request = Signal(int, str)  # n_ctx, why: reload the engine with this context
    approval_needed = Signal(object)  # PendingCall (app.gui.tool_loop), None: none waits

    def __init__(self, store: ConversationStore, worker: EngineWorker,
                 transcript: TranscriptModel, save_interval_s: float = 0.5,
                 save_every: int = 16, parent: QObject | None = None,
                 tool_servers: ToolServers | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.worker = worker
        self.transcript = transcript
        self.save_interval_s = save_interval_s
        self.save_every = save_every
        self.loop_monitor = LoopLagMonitor(parent=self)
        self.current_id: int | None = None
        self.active: _Active | None = None
        self.engine_ready = False
        self.n_ctx: int | None = None  # the loaded engine's context (EngineReady.n_ctx)
        self.max_ctx = 0  # the largest a reload may ask for (EngineReady.max_ctx)
        self._ids = itertools.count(1)
        self._tool_limit = 0  # set by _request: the limit when it withheld the tools
        self._loop_start: int | None = None  # the first answer of the loop in progress
        self.pending: list[Document] = []  # attached, not sent yet
        self.documents = DocumentLoader(self)
        self.documents.loaded.connect(self._add_pending)
        self.documents.failed.connect(self.problem)
        self.documents.reading_changed.connect(self.reading_changed)
        # Tool calls between answers: approvals, runs, results (app.gui.tool_loop)
        self.tools = ToolLoop(store, tool_servers, self)
        self.tools.approval_needed.connect(self.approval_needed)
        self.tools.message_changed.connect(self._on_card)
        self.tools.round_done.connect(self._next_round)
        self.tools.ended.connect(self._done)
        # Where a regenerate or an edit cut the branch: the calls its old versions made
        # (at or below this position) give their results back when made again.
        self._replay_from: int | None = None
        worker.text.connect(self._on_text)
        worker.finished.connect(self._on_finished)
        worker.compared.connect(self._on_compared)
        worker.failed.connect(self._on_failed)

    @property
    def busy(self) -> bool:
        return self.active is not None or self.tools.running

    # --- conversations ---------------------------------------------------------------
    def open_conversation(self, conversation_id: int) -> None:
        self.current_id = conversation_id
        messages = self.store.messages(conversation_id)
        a = self.active
        if a is not None and a.message is not None and a.conversation_id == conversation_id:
            # The store lags the stream by up to one save interval: show what we have.
            messages = [replace(m, content=a.content) if m.id == a.message.id else m
                        for m in messages]
        self.transcript.set_messages(messages)
        self.conversation_opened.emit(conversation_id)

    def new_conversation(self) -> int:
        settings = ChatSettings()
        system = ""
        if self.current_id is not None:  # a new chat starts with the current settings
            cur = self.store.conversation(self.current_id)
            settings, system = cur.settings, cur.system_prompt
        conv = self.store.create_conversation(system_prompt=system, settings=settings)
        self.conversations_changed.emit()
        self.open_conversation(conv.id)
        return conv.id

    def delete_conversation(self, conversation_id: int) -> None:
        loop = self.tools.round
        if loop is not None and loop.conversation_id == conversation_id:
            self.tools.stop()  # its calls would go on in a conversation that is gone
        if self.active is not None and self.active.conversation_id == conversation_id:
            self.stop()
            self.problem.emit("Stop the answer first; then delete the conversation.")
            return
        self.store.delete_conversation(conversation_id)
        self.conversations_changed.emit()
        if conversation_id == self.current_id:
            rest = self.store.conversations()
            if rest:
                self.open_conversation(rest[0].id)
            else:
                self.current_id = None
                self.new_conversation()

    def update_settings(self, system_prompt: str, settings: ChatSettings) -> None:
        if self.current_id is not None:
            self.store.update_conversation(self.current_id, system_prompt=system_prompt,
                                           settings=settings)

    # --- attachments -----------------------------------------------------------------
    def attach_files(self, paths: list[Path]) -> None:
        """Read ``paths`` off this thread; each becomes pending, or a ``problem``."""
        self.documents.read(paths)

    def attach_text(self, text: str) -> None:
        """A long paste, pending as a document instead of text in the message box."""
        try:
            self._add_pending(document_from_text(paste_name(text), text))
        except DocumentError as exc:
            self.problem.emit(str(exc))

    def remove_pending(self, index: int) -> None:
        if 0 <= index < len(self.pending):
            del self.pending[index]
            self.attachments_changed.emit(list(self.pending))

    def _still_reading(self) -> bool:
        """Files being read go with the next message: it waits for them."""
        if self.documents.reading:
            self.problem.emit(f"Still reading {', '.join(self.documents.reading)}: send once "
                              "it is attached.")
        return bool(self.documents.reading)

    def _add_pending(self, document: Document) -> None:
        self.pending.append(document)
        self.attachments_changed.emit(list(self.pending))

    # --- chat actions ----------------------------------------------------------------
    def send(self, text: str) -> bool:
        """Append a user message with the pending documents and answer it; False when
        busy or nothing to send. Its tool calls run (a new message replays nothing)."""
        if not self.busy:
            self._replay_from = None
        return self._send(text, [])

    def _send(self, text: str, carried: list[int]) -> bool:
        """``carried``: attachments of an edited message its new version takes along."""
        text = text.strip()
        if (not text and not self.pending and not carried) or self.busy:
            return False
        if self._still_reading():
            return False
        if self.current_id is None:
            self.new_conversation()
        assert self.current_id is not None
        conv = self.store.conversation(self.current_id)
        documents, self.pending = self.pending, []
        if not any(m.role == "user" for m in self.transcript.messages):
            self.store.update_conversation(
                conv.id, title=_title(text or ", ".join(d.name for d in documents)))
            self.conversations_changed.emit()
        msg = self.store.add_message(conv.id, "user", text)
        attachments = self.store.copy_attachments(carried, msg.id) if carried else []
        attachments += [self.store.add_attachment(conv.id, d, msg.id) for d in documents]
        if documents:
            self.attachments_changed.emit([])
        earlier = [] if attachments else searched_again(self.store, msg)
        if attachments or earlier:
            if attachments:
                self._grow_context(conv, msg, attachments)
            info = compose_user_turn(self.store, conv, msg, attachments or earlier,
                                     self.n_ctx, own=bool(attachments))
            self.store.update_message(msg.id, text, COMPLETE, info)
            msg = replace(msg, info=info)
        self.transcript.append(msg)
        return self._answer(conv.id)

    def _grow_context(self, conv: Conversation, msg: Message,
                      attachments: list[Attachment]) -> None:
        """Documents that would fit whole in a larger context the model can take here:
        ask for it (the engine reloads before it answers; the request waits in its
        queue)."""
        if self.n_ctx is None or not self.engine_ready:
            return
        grown = context_for_documents(self.store, conv, msg, attachments, self.n_ctx,
                                      self.max_ctx)
        if grown is not None:
            self.n_ctx = grown
            self.context_request.emit(grown, f"Context raised to {grown:,} tokens for the "
                                             "attached documents.")

    def regenerate(self, run_tools_again: bool = False) -> bool:
        """Answer the last user message again; the answer it had stays a version. Tool
        calls the answer makes again get their earlier results back, unless
        ``run_tools_again``."""
        if self.busy or self.current_id is None:
            return False
        users = [m for m in self.transcript.messages if m.role == "user"]
        if not users:
            return False
        self._truncate(users[-1].position + 1)
        self._replay_from = None if run_tools_again else users[-1].position + 1
        return self._answer(self.current_id)

    def edit_and_resend(self, message_id: int, text: str) -> bool:
        """A new version of a user message, ``text``, then its answer; the old version
        and what followed it stay (``switch_version``)."""
        if self.busy or self.current_id is None or not text.strip():
            return False
        msg = self.store.message(message_id)
        if msg.conversation_id != self.current_id or msg.role != "user" \
                or self._still_reading():
            return False
        carried = [a.id for a in self.store.message_attachments(message_id)]
        self._truncate(msg.position)
        self._replay_from = msg.position
        return self._send(text, carried)

    def abandon(self) -> None:
        """The app is closing: save the answer being written as stopped, now."""
        self.tools.stop()
        a = self.active
        if a is not None and a.message is not None:
            info = {"summary": "stopped: Tandem was closed", "finish_reason": "cancelled"}
            self.store.update_message(a.message.id, a.content, STOPPED, info)
        self.active = None
        self.loop_monitor.stop()

    def stop(self) -> None:
        """Stop the answer being written, or the tool loop between answers (at once)."""
        if self.active is not None:
            self.worker.request_stop(self.active.request_id)
        else:
            self.tools.stop()

    def approve_call(self, always: bool = False) -> None:
        """Run the call waiting for approval (``always``: this tool never asks again)."""
        self.tools.approve(always)

    def refuse_call(self) -> None:
        self.tools.refuse()

    def compare(self) -> bool:
        """Run the last prompt with the drafter and with plain decoding (no store write)."""
        if self.busy or self.current_id is None:
            return False
        users = [m for m in self.transcript.messages if m.role == "user"]
        if not users:
            self.problem.emit("Send a message first: the comparison reuses its prompt.")
            return False
        history = [m for m in self.transcript.messages if m.position <= users[-1].position]
        request = self._request(self.current_id, history)
        if request is None:
            return False
        self.active = _Active(request.request_id, "compare", self.current_id)
        self._set_busy()
        self.started.emit(request.request_id, "compare")
        self.compare_request.emit(request)
        return True

    # --- internals -------------------------------------------------------------------
    def _truncate(self, position: int) -> None:
        """Cut the branch on show before ``position``: what was there stays a version."""
        assert self.current_id is not None
        self.store.branch_at(self.current_id, position)
        self.transcript.truncate(position)

    def switch_version(self, message_id: int, step: int) -> bool:
        """Show the previous (-1) or next (+1) version at a message's place, and the
        branch below it. The engine reuses the prompt cache up to where they differ."""
        if self.busy or self.current_id is None:
            return False
        versions = self.store.siblings(message_id)
        i = next((k for k, m in enumerate(versions) if m.id == message_id), None)
        if i is None or not 0 <= i + step < len(versions):
            return False
        self.store.switch_to(versions[i + step].id)
        self.open_conversation(self.current_id)
        return True

    def delete_version(self, message_id: int) -> bool:
        """Delete a version and what follows it; another version shows instead."""
        if self.busy or self.current_id is None:
            return False
        self.store.delete_branch(message_id)
        self.open_conversation(self.current_id)
        self.conversations_changed.emit()
        return True

    def _request(self, conversation_id: int, history: list[Message]
                 ) -> GenerationRequest | None:
        conv = self.store.conversation(conversation_id)
        s = conv.settings
        try:
            sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p,
                                      top_k=s.top_k, seed=s.seed, min_p=s.min_p,
                                      repeat_penalty=s.repeat_penalty,
                                      frequency_penalty=s.frequency_penalty,
                                      presence_penalty=s.presence_penalty)
            grammar = answer_grammar(s)
        except InvalidSamplingError as exc:
            self.problem.emit(str(exc))
            return None
        # A user message that brought documents: the text the model read with it.
        turns = [turn for m in history if model_text(m) or calls_of(m.info)
                 for turn in expand(m.role, model_text(m), m.info)]
        if conv.system_prompt.strip():
            turns.insert(0, {"role": "system", "content": conv.system_prompt.strip()})
        # The file an edit will likely repeat, drafted from (never changes the answer),
        # when the newest message asks for an edit (what the user typed, not its documents).
        attached = [a for m in history if m.role == "user"
                    for a in self.store.message_attachments(m.id)]
        asked = next((m.content for m in reversed(history) if m.role == "user"), "")
        prediction = edit_prediction(attached, [m.content for m in history
                                                if m.role == "assistant"],
                                     asked, self.n_ctx or 4096)
        tools, at_limit = self.tools.tools_for(s, history) if grammar is None else ((), False)
        self._tool_limit = s.tool_rounds if at_limit else 0
        return GenerationRequest(next(self._ids), tuple(turns), sampling, s.max_tokens,
                                 s.context_policy, s.thinking, grammar, prediction, tools,
                                 s.tool_choice)

    def _answer(self, conversation_id: int, continuing: bool = False) -> bool:
        """Answer the conversation as it stands; ``continuing``: the next answer of a
        tool loop, after its calls' results."""
        request = self._request(conversation_id, self.store.messages(conversation_id))
        if request is None:
            return False
        msg = self.store.add_message(conversation_id, "assistant", "", STREAMING)
        if not continuing:  # not a loop's next answer: a loop may start here
            self._loop_start = msg.id
        if conversation_id == self.current_id:
            self.transcript.append(msg)
        self.active = _Active(request.request_id, "answer", conversation_id, msg,
                              t_saved=time.monotonic(), tool_limit=self._tool_limit)
        self._set_busy()
        self.started.emit(request.request_id, "answer")
        if not self.engine_ready:
            self.problem.emit("The model is still loading; the answer starts once it is "
                              "ready.")
        self.generate_request.emit(request)
        return True

    def _set_busy(self) -> None:
        self.loop_monitor.start()
        self.busy_changed.emit(True)

    def _done(self) -> None:
        self.active = None
        self.loop_monitor.stop()
        self.busy_changed.emit(False)

    def _is_current(self, a: _Active) -> bool:
        return a.conversation_id == self.current_id

    def _on_text(self, request_id: int, delta: str) -> None:
        a = self.active
        if a is None or a.request_id != request_id or a.message is None:
            return
        a.content += delta
        a.n_unsaved += 1
        if self._is_current(a):
            self.transcript.append_text(delta)
        now = time.monotonic()
        if a.n_unsaved >= self.save_every or now - a.t_saved >= self.save_interval_s:
            self.store.update_message(a.message.id, a.content, STREAMING)
            a.t_saved, a.n_unsaved = now, 0

    def _on_finished(self, outcome: GenerationOutcome) -> None:
        a = self.active
        if a is None or a.request_id != outcome.request_id or a.message is None:
            return
        status = STOPPED if outcome.finish_reason == "cancelled" else COMPLETE
        summary = summary_line(outcome.stats, outcome.finish_reason)
        if a.tool_limit:
            rounds = "1 round" if a.tool_limit == 1 else f"{a.tool_limit} rounds"
            summary = (f"{rounds} of tool calls (the limit, in Settings): answered "
                       f"without tools · {summary}")
        if outcome.n_dropped:  # the window marks what the model no longer saw
            summary = (f"the {outcome.n_dropped} oldest messages were left out to fit the "
                       f"context · {summary}")
        info = {"summary": summary, "finish_reason": outcome.finish_reason,
                "stats": outcome.stats.summary(), "context_dropped": outcome.n_dropped}
        self.store.update_message(a.message.id, outcome.text, status, info)
        finished = replace(a.message, content=outcome.text, status=status, info=info)
        if self._is_current(a):
            self.transcript.replace_last(finished)
        if outcome.calls and status == COMPLETE:
            # The loop goes on: calls, approvals and results, then the next answer.
            self.active = None
            self.answer_finished.emit(outcome)  # before the next round can start
            self.tools.begin(finished, outcome.call_content or "", outcome.calls,
                             self._replay_from, self._loop_start or finished.id,
                             self._result_chars())
            return
        self._replay_from = None
        self._done()
        self.conversations_changed.emit()
        self.answer_finished.emit(outcome)

    def _next_round(self, conversation_id: int) -> None:
        """Every call of the round is answered: the model answers again with them."""
        if not self._answer(conversation_id, continuing=True):
            self._replay_from = None
            self._done()  # (the reason was told: a bad setting, say)

    def _result_chars(self) -> int:
        """The longest tool result the model is given: about half the context (results
        come back in every later turn of the chat)."""
        return max(2_000, 2 * (self.n_ctx or 4096))

    def _on_card(self, message: Message) -> None:
        """A tool call's card changed (decided, running, answered): show it."""
        if message.conversation_id == self.current_id and self.transcript.messages and \
                self.transcript.messages[-1].id == message.id:
            self.transcript.replace_last(message)

    def _on_compared(self, comparison: Comparison) -> None:
        if self.active is not None and self.active.request_id == comparison.request_id:
            self._done()
            self.comparison_finished.emit(comparison)

    def _on_failed(self, failure: EngineFailure) -> None:
        a = self.active
        if a is None or a.request_id != failure.request_id:
            return
        if a.message is not None:
            info = {"error": failure.message, "kind": failure.kind}
            self.store.update_message(a.message.id, a.content, FAILED, info)
            if self._is_current(a):
                self.transcript.replace_last(replace(a.message, content=a.content,
                                                     status=FAILED, info=info))
        self._done()
        self.problem.emit(failure.message)


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1] + "…"
