"""One round of a tool loop in the window: the calls an answer made, each approved (once
or always for its tool), refused or replayed, run on its server, its result kept in the
answer's card; then the controller answers again with the results.

Calls are handled one at a time, in the order the model wrote them. Nothing waits: an
approval is a signal the window shows, a result is a signal from app.gui.tool_servers.
The card is saved at every change, so a closed app keeps what was decided and returned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.conversation_store import COMPLETE, ChatSettings, ConversationStore, Message
from app.gui.tool_servers import ToolServers
from app.tools import turns
from app.tools.mcp_host import ToolCallError, ToolInfo, ToolOutcome
from engine.tool_calls import Tool, ToolCall


@dataclass(frozen=True)
class PendingCall:
    """A call waiting for the user: approve once, always for this tool, or refuse."""

    message_id: int
    index: int
    call: dict[str, Any]


@dataclass
class _Round:
    conversation_id: int
    message: Message
    calls: list[dict[str, Any]]
    replay: dict[str, dict[str, Any]]
    max_result_chars: int  # a longer result is cut (the context has room for so much)
    running: tuple[int, int] | None = None  # the key of the call on its server


class ToolLoop(QObject):
    approval_needed = Signal(object)  # PendingCall, or None: nothing waits any more
    message_changed = Signal(object)  # Message: the card changed (saved already)
    round_done = Signal(int)  # conversation id: every call answered, answer again
    ended = Signal()  # Stop ended the round

    def __init__(self, store: ConversationStore, servers: ToolServers | None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.servers = servers
        self.round: _Round | None = None
        self.pending: PendingCall | None = None
        # The tools the last request offered, by the name the model saw: its calls go to
        # these (a server starting or stopping meanwhile renames nothing).
        self.offered: dict[str, ToolInfo] = {}
        if servers is not None:
            servers.call_done.connect(self._on_result)

    @property
    def running(self) -> bool:
        return self.round is not None

    def tools_for(self, settings: ChatSettings, history: list[Message]
                  ) -> tuple[tuple[Tool, ...], bool]:
        """The tools an answer is offered, and whether the loop is at its limit (then
        none are: the model answers with what it has)."""
        if self.servers is None or not settings.use_tools:
            return (), False
        tools = self.servers.tools()
        if not tools:
            return (), False
        rounds = turns.rounds_since_user([(m.role, m.info) for m in history])
        if rounds >= max(0, settings.tool_rounds):
            return (), True
        self.offered = {t.public_name: t for t in tools}
        return tuple(t.as_tool() for t in tools), False

    def begin(self, message: Message, content: str, calls: tuple[ToolCall, ...],
              replay_from: int | None, loop_start: int, max_result_chars: int) -> None:
        """Keep ``calls`` in ``message``'s card and handle them. ``replay_from``: where a
        regenerate or an edit cut the branch; a call its old versions (at or below that
        position, made before the loop's first answer ``loop_start``) answered gets that
        result back instead of running again. None: every call runs."""
        known = self.offered
        records = []
        for i, call in enumerate(calls):
            info = known.get(call.name)
            record = turns.new_call(message.id, i, call.name, info.server if info else "",
                                    info.name if info else call.name, call.arguments)
            if info is None:
                record.update(state=turns.FAILED, result="no running server offers "
                                                         f"{call.name}")
            records.append(record)
        earlier = turns.replayable(self.store.tool_call_records(message.conversation_id,
                                                                replay_from),
                                   loop_start) if replay_from is not None else {}
        message = replace(message, content=content,
                          info={**message.info, "tool_calls": records})
        self.round = _Round(message.conversation_id, message, records, earlier,
                            max_result_chars)
        self._save()
        self._next()

    # --- the user's decisions ------------------------------------------------------------
    def approve(self, always: bool = False) -> None:
        pending = self._take_pending()
        if pending is None or self.round is None:
            return
        call = self.round.calls[pending.index]
        call["approval"] = "always" if always else "once"
        if always and self.servers is not None:
            self.servers.allow_always(call["server"], call["tool"])
        self._run(pending.index)

    def refuse(self) -> None:
        pending = self._take_pending()
        if pending is None or self.round is None:
            return
        self.round.calls[pending.index].update(state=turns.REFUSED, approval="refused")
        self._save()
        self._next()

    def stop(self) -> None:
        """End the round now: open calls are marked stopped (a running one abandoned)."""
        r = self.round
        if r is None:
            return
        if r.running is not None and self.servers is not None:
            self.servers.cancel(r.running)
        for call in r.calls:
            if call["state"] in turns.OPEN:
                call["state"] = turns.STOPPED
        self._save()
        self.round = None
        self._take_pending()
        self.ended.emit()

    # --- internals -------------------------------------------------------------------------
    def _take_pending(self) -> PendingCall | None:
        pending, self.pending = self.pending, None
        if pending is not None:
            self.approval_needed.emit(None)
        return pending

    def _next(self) -> None:
        r = self.round
        assert r is not None
        for i, call in enumerate(r.calls):
            if call["state"] != turns.WAITING:
                continue
            earlier = r.replay.get(turns.call_key(call["server"], call["tool"],
                                                  call["arguments"]))
            if earlier is not None:
                call.update(state=turns.REPLAYED, result=earlier.get("result", ""),
                            is_error=bool(earlier.get("is_error")), approval="replay")
                self._save()
                continue
            if self.servers is not None and self.servers.always_allowed(call["server"],
                                                                        call["tool"]):
                call["approval"] = "always"
                self._run(i)
                return
            self.pending = PendingCall(r.message.id, i, dict(call))
            self.approval_needed.emit(self.pending)
            return
        self.round = None
        self.round_done.emit(r.conversation_id)

    def _run(self, index: int) -> None:
        r = self.round
        assert r is not None and self.servers is not None
        call = r.calls[index]
        call["state"] = turns.RUNNING
        self._save()
        r.running = (r.message.id, index)
        self.servers.call(r.running, call["server"], call["tool"], call["arguments"])

    def _on_result(self, key: object, outcome: ToolOutcome | ToolCallError) -> None:
        r = self.round
        if r is None or key != r.running:
            return  # a call Stop abandoned
        r.running = None
        call = r.calls[key[1]]  # type: ignore[index]
        if isinstance(outcome, ToolOutcome):
            text, most = outcome.text, r.max_result_chars
            if len(text) > most:
                text = text[:most] + f"\n… ({len(text) - most:,} more characters cut)"
            call.update(state=turns.DONE, result=text, is_error=outcome.is_error)
        else:
            call.update(state=turns.FAILED, result=str(outcome))
        self._save()
        self._next()

    def _save(self) -> None:
        r = self.round
        assert r is not None
        info = {**r.message.info, "tool_calls": [dict(c) for c in r.calls]}
        r.message = replace(r.message, info=info, status=COMPLETE)
        self.store.update_message(r.message.id, r.message.content, COMPLETE, info)
        self.message_changed.emit(r.message)
