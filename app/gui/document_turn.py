"""A user message that brings documents: what the model reads with it, and the room the
documents get in the context.

The composed text is stored in the message's info (``model_text``, with the ``passages``
given and whether the documents went ``whole``), so a later turn, a regenerate and an
edit's replay send exactly what the model saw the first time.
"""

from __future__ import annotations

from app.conversation_store import Attachment, Conversation, ConversationStore, Message
from app.documents.context import compose_turn, tokens_wanted
from app.gui.context_room import STEP
from engine.runtime.context_fit import answer_room
from engine.session import DEFAULT_CTX

# The share of the context one turn may take, so the answer and the system prompt keep
# room even when the older turns are dropped.
TURN_SHARE = 0.85
# Tokens a message's chat-template wrapping takes (role markers, newlines), over-counted.
PER_MESSAGE = 8


def estimate_tokens(text: str) -> int:
    """Tokens in ``text``, over-counted rather than under: about 3 characters a token
    (English BPE averages near 4) and one more per extra UTF-8 byte pair (CJK and other
    scripts take about a token a character).

    Why not the model's tokenizer: it lives in the engine's thread, which may be busy
    answering for a minute, and the GUI thread never waits on it. The estimate only
    chooses whole documents or passages; the engine's own context fitting counts exact
    tokens and drops the oldest turns (or refuses, by the chat's policy) if it is off.
    """
    extra = len(text.encode("utf-8", errors="replace")) - len(text)
    return len(text) // 3 + extra // 2 + PER_MESSAGE


def turn_budget(n_ctx: int, max_tokens: int, rest_tokens: int) -> int:
    """Tokens the new turn (documents and question) may take: what the context keeps
    beside the answer's room and the rest of the conversation (``rest_tokens``), at most
    ``TURN_SHARE`` of the context, and never under half that: the engine drops the oldest
    turns to make room for the newest, which is the one the documents are for."""
    room = n_ctx - answer_room(n_ctx, max_tokens)
    cap = min(int(n_ctx * TURN_SHARE), room)
    return max(cap // 2, min(cap, room - rest_tokens))


def model_text(msg: Message) -> str:
    """What the model reads for a message: a user turn's composition, else its text."""
    if msg.role == "user" and msg.info.get("model_text"):
        return str(msg.info["model_text"])
    return msg.content


def rest_tokens(conv: Conversation, history: list[Message]) -> int:
    """The estimated tokens of the system prompt and the messages before the new one."""
    texts = [conv.system_prompt] + [model_text(m) for m in history]
    return sum(estimate_tokens(t) for t in texts if t)


def attachment_info(attachments: list[Attachment]) -> list[dict]:
    """What the window shows of a message's documents (the chips) without reading them."""
    return [{"id": a.id, "name": a.name, "kind": a.kind, "chars": a.n_chars,
             "pages": len(a.pages)} for a in attachments]


def history_before(store: ConversationStore, msg: Message) -> list[Message]:
    return [m for m in store.messages(msg.conversation_id) if m.position < msg.position]


def context_for_documents(store: ConversationStore, conv: Conversation, msg: Message,
                          attachments: list[Attachment], n_ctx: int, max_ctx: int
                          ) -> int | None:
    """The context to reload the model with so that ``attachments`` go whole with
    ``msg``: the smallest step above ``n_ctx`` whose turn budget holds them; None when
    they fit now, or would only past ``max_ctx`` (their best passages go then)."""
    need = tokens_wanted(attachments, estimate_tokens) + estimate_tokens(msg.content)
    rest = rest_tokens(conv, history_before(store, msg))
    max_tokens = conv.settings.max_tokens
    if need <= turn_budget(n_ctx, max_tokens, rest) or max_ctx <= n_ctx:
        return None
    for n in [*range((n_ctx // STEP + 1) * STEP, max_ctx, STEP), max_ctx]:
        if turn_budget(n, max_tokens, rest) >= need:
            return n
    return None


def searched_again(store: ConversationStore, msg: Message) -> list[Attachment]:
    """Documents sent earlier on this branch that went as passages: a follow-up question
    (``msg``, sent without documents) gets the passages that match it. Those that went
    whole are in the conversation already."""
    partial = {m.id for m in history_before(store, msg)
               if m.role == "user" and m.info.get("attachments") and not m.info.get("whole")}
    return [a for a in store.path_attachments(msg.conversation_id) if a.message_id in partial]


def compose_user_turn(store: ConversationStore, conv: Conversation, msg: Message,
                      attachments: list[Attachment], n_ctx: int | None,
                      own: bool = True) -> dict:
    """The info to store on ``msg`` (just added): the text the model reads for it and
    what of ``attachments`` that holds; ``own``: they came with it (its chips), else
    they are earlier documents searched again."""
    budget = turn_budget(n_ctx or DEFAULT_CTX, conv.settings.max_tokens,
                         rest_tokens(conv, history_before(store, msg)))
    ids = [a.id for a in attachments]
    turn = compose_turn(msg.content, attachments, budget, estimate_tokens,
                        lambda query, limit: store.search_passages(conv.id, query, limit,
                                                                   attachment_ids=ids))
    info = {"model_text": turn.text, "passages": [p.to_dict() for p in turn.passages],
            "whole": turn.whole, "budget_tokens": budget}
    if own:
        info["attachments"] = attachment_info(attachments)
    return info
