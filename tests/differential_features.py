"""The differential's feature actions (tests/differential.py): an attached document, a tool
round, a predicted output and a JSON-schema answer, each built by the code the app or the
API builds it with, so that a drafted session is compared with plain decoding on the path
a user's request takes.

- ``document``: the window's path (app.gui.document_turn over a real ConversationStore in
  SQLite): the document goes whole when it fits the turn's budget, else its best passages
  (FTS5 search); ``raised``, a document that fits whole only in a larger context, first
  reloads every session with the context the window asks for (``context_for_documents``).
- ``tool_round``: the window's tool loop (app.tools.turns) in a new chat: an answer held
  to one call by the grammar (tool choice "required"), then the answer after that call's
  result; the chat goes on with the tools offered.
- ``prediction`` and ``json_schema``: the API's path (app.server.schema.parse_request, then
  the lane's ``question_of``): OpenAI's ``prediction`` (right: plain decoding's own answer;
  perturbed: that answer with words changed; unrelated: another text) and
  ``response_format`` with a JSON schema.

Nothing here decodes: ``Sessions`` (tests/differential.py) asks the questions built here of
every session and compares the answers.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.conversation_store import ChatSettings, ConversationStore
from app.documents.reading import Document
from app.gui.document_turn import compose_user_turn, context_for_documents
from app.server.lane import Job, question_of
from app.server.schema import Limits, parse_request
from app.tools.turns import DONE, expand, for_model, new_call
from engine.decoding.generation import GenerationConfig
from engine.decoding.sampling import CHAT_DEFAULTS, SamplingParams
from engine.tool_calls import Tool
from engine.tool_syntax import ToolSyntax

if TYPE_CHECKING:
    from engine.conversation import Question
    from tests.differential import Action

FEATURE_KINDS = ("document", "tool_round", "prediction", "json_schema")
# The raised context reloads every session (seconds each): rarer than the others.
DOCUMENT_MODES = {"whole": 0.45, "passages": 0.45, "raised": 0.1}
PREDICTION_MODES = ("right", "perturbed", "unrelated")
TEMPERATURE = 0.8  # seeded sampling, as the other sampled actions

# Document sizes in characters, for a 1024-token context (the CLI's default): the window
# estimates 3 characters a token and gives a turn at most 85% of the context.
WHOLE_CHARS = (250, 900)
RAISED_CHARS = (3000, 4800)  # over 1024's budget, within 2048's
PASSAGES_CHARS = (6000, 9000)  # over 2048's too: passages either way

TOOLS = (
    Tool("get_weather", "The weather now in a city.",
         {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
          "required": ["city"]}),
    Tool("convert_units", "Convert an amount between units.",
         {"type": "object", "properties": {
             "amount": {"type": "number"},
             "unit": {"type": "string", "enum": ["km", "mi", "kg", "lb", "C", "F"]}},
          "required": ["amount", "unit"]}),
)
TOOL_QUESTIONS = ("What is the weather in {city} today?",
                  "Should I take an umbrella in {city}?",
                  "How much is 12 km in miles?", "Convert 70 F to Celsius, please.")
CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Hanoi")
# A call takes 24-34 tokens on the bundled model; the grammar ends it (then only an end of
# generation is admitted), so the call's answer gets this many whatever the action's limit.
CALL_TOKENS = 64

SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": ("Describe a made-up person as JSON: name, age and city.",
               {"type": "object", "properties": {
                   "name": {"type": "string", "maxLength": 30},
                   "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 30}},
                "required": ["name", "age", "city"], "additionalProperties": False}),
    "verdict": ("Is the sea salty? Answer as JSON with a yes/no answer and a reason.",
                {"type": "object", "properties": {
                    "answer": {"type": "string", "enum": ["yes", "no"]},
                    "reason": {"type": "string", "maxLength": 80}},
                 "required": ["answer", "reason"], "additionalProperties": False}),
    "list": ("List three fruits as JSON.",
             {"type": "object", "properties": {
                 "fruits": {"type": "array", "items": {"type": "string", "maxLength": 20},
                            "minItems": 1, "maxItems": 3}},
              "required": ["fruits"], "additionalProperties": False}),
}
EDIT_ASKS = ("Rewrite this text with simpler words:", "Fix any mistakes in this text:",
             "Repeat this text, changing nothing:")


def feature_action(rng: random.Random, kind: str, short: list[str], long: list[str],
                   mode: str | None = None, sampled: bool | None = None) -> Action:
    """A random ``kind`` action (one of FEATURE_KINDS) from the dev prompts' texts
    (``long``: documents and texts to edit; ``short``: questions); ``mode`` and
    ``sampled`` (seeded sampling, else greedy) where given, else drawn."""
    from tests.differential import Action

    seed = rng.randint(0, 2**31 - 1)
    if not (rng.random() < 0.5 if sampled is None else sampled):
        seed = None
    if kind == "document":
        mode = mode or rng.choices(list(DOCUMENT_MODES), list(DOCUMENT_MODES.values()))[0]
        low, high = {"whole": WHOLE_CHARS, "raised": RAISED_CHARS,
                     "passages": PASSAGES_CHARS}[mode]
        text = document_text(rng, long, rng.randint(low, high))
        return Action(kind, document_question(rng, text), rng.randint(4, 24), seed,
                      mode=mode, extra=text)
    if kind == "tool_round":
        question = rng.choice(TOOL_QUESTIONS).format(city=rng.choice(CITIES))
        return Action(kind, question, rng.randint(8, 32), seed)
    if kind == "json_schema":
        name = mode or rng.choice(list(SCHEMAS))
        return Action(kind, SCHEMAS[name][0], rng.randint(8, 32), seed, mode=name)
    if kind == "prediction":
        mode = mode or rng.choice(PREDICTION_MODES)
        snippet = _cut(rng.choice(short + long), rng.randint(80, 300))
        other = _cut(rng.choice(long), rng.randint(80, 400)) if mode == "unrelated" else ""
        return Action(kind, f"{rng.choice(EDIT_ASKS)}\n\n{snippet}", rng.randint(8, 32),
                      seed, mode=mode, extra=other)
    raise ValueError(f"not a feature action: {kind}")


def document_text(rng: random.Random, long: list[str], n_chars: int) -> str:
    """About ``n_chars`` of the long texts, paragraphs from several when one is short."""
    parts: list[str] = []
    while sum(len(p) + 2 for p in parts) < n_chars:
        parts.append(rng.choice(long).strip())
    return _cut("\n\n".join(parts), n_chars)


def document_question(rng: random.Random, text: str) -> str:
    """A question on a word of the document (so that search finds passages with it)."""
    words = [w for w in re.findall(r"[A-Za-z]{6,}", text)] or ["document"]
    return rng.choice(("What does the document say about {w}?",
                       "Summarize what is said about {w}.",
                       "Quote the sentence that mentions {w}.")).format(w=rng.choice(words))


def _cut(text: str, n_chars: int) -> str:
    """``text`` cut to at most ``n_chars`` at a space (whole words)."""
    if len(text) <= n_chars:
        return text.strip()
    cut = text.rfind(" ", 0, n_chars)
    return text[:cut if cut > 0 else n_chars].strip()


def chat_sampling(action: Action) -> SamplingParams:
    """The window's sampling for a chat (app.gui.chat_controller: ChatSettings' defaults,
    a repeat penalty among them), greedy or seeded."""
    if action.seed is None:
        return SamplingParams(min_p=CHAT_DEFAULTS.min_p,
                              repeat_penalty=CHAT_DEFAULTS.repeat_penalty)
    return SamplingParams(temperature=TEMPERATURE, seed=action.seed, min_p=CHAT_DEFAULTS.min_p,
                          repeat_penalty=CHAT_DEFAULTS.repeat_penalty)


# --- documents (the window's path) ------------------------------------------------------
class DocumentTurn:
    """A user message with ``action``'s document after ``history``, as the window keeps
    it: a conversation in ``store`` with that history, the message and its attachment."""

    def __init__(self, store: ConversationStore, history: list[dict[str, str]],
                 action: Action) -> None:
        self.store = store
        # A system message is the conversation's system prompt there (a tool offer).
        system = "\n\n".join(m["content"] for m in history if m["role"] == "system")
        self.conv = store.create_conversation(
            "differential", system, ChatSettings(max_tokens=action.max_tokens,
                                                 temperature=TEMPERATURE if action.seed
                                                 is not None else 0.0, seed=action.seed))
        for m in history:
            if m["role"] != "system":
                store.add_message(self.conv.id, m["role"], m.get("content") or "")
        self.msg = store.add_message(self.conv.id, "user", action.text)
        document = Document("notes.txt", "text", action.extra)
        self.attachments = [store.add_attachment(self.conv.id, document, self.msg.id)]

    def grown_context(self, n_ctx: int, max_ctx: int) -> int | None:
        """The context the window reloads the model with so the document goes whole
        (None: it fits now, or not even at ``max_ctx``)."""
        return context_for_documents(self.store, self.conv, self.msg, self.attachments,
                                     n_ctx, max_ctx)

    def user_message(self, n_ctx: int) -> tuple[dict[str, str], bool]:
        """The user message the model reads (the window's ``model_text``), and whether
        the document went whole."""
        info = compose_user_turn(self.store, self.conv, self.msg, self.attachments, n_ctx)
        return {"role": "user", "content": info["model_text"]}, bool(info["whole"])


def open_store(work: Path) -> ConversationStore:
    return ConversationStore(work / "documents.db")


# --- a tool round (the window's tool loop) ----------------------------------------------
def tool_call_question(history: list[dict[str, Any]], action: Action, syntax: ToolSyntax
                       ) -> Question:
    """The answer that must call one of TOOLS (held by the call grammar)."""
    turn = for_model([*history, {"role": "user", "content": action.text}], list(TOOLS),
                     syntax, required=True)
    return _tool_question(turn.messages, turn.template_tools, turn.grammar, action,
                          max(action.max_tokens, CALL_TOKENS))


def tool_result_turns(history: list[dict[str, Any]], action: Action, syntax: ToolSyntax,
                      call_text: str) -> list[dict[str, Any]]:
    """The conversation after the call answer ``call_text`` (the API's messages: the
    assistant's calls and a ``tool`` message with each one's result), as app.tools.turns
    keeps it. An answer cut before its call ends calls the first tool with made-up
    arguments: the next answer is still one after a tool's result."""
    read = syntax.read(call_text, list(TOOLS))
    calls = [(c.name, c.arguments) for c in read.calls] if read is not None else \
        [(TOOLS[0].name, {"city": CITIES[0]})]
    records = []
    for i, (name, arguments) in enumerate(calls):
        call = new_call(1, i, name, "differential", name, arguments)
        call.update(state=DONE, result=tool_result(name, arguments))
        records.append(call)
    content = (read.content or "") if read is not None else ""
    return [*history, {"role": "user", "content": action.text},
            *expand("assistant", content, {"tool_calls": records})]


def tool_result_question(turns: list[dict[str, Any]], action: Action, syntax: ToolSyntax
                         ) -> Question:
    """The answer after the results, the tools still offered (no call required)."""
    turn = for_model(turns, list(TOOLS), syntax, required=False)
    return _tool_question(turn.messages, turn.template_tools, turn.grammar, action)


def tool_result(name: str, arguments: dict) -> str:
    """A tool's result, the same for the same call."""
    if name == "get_weather":
        city = str(arguments.get("city", ""))
        return json.dumps({"city": city, "temperature_c": 8 + len(city) % 17,
                           "conditions": ("rain", "sun", "cloud")[len(city) % 3]})
    return json.dumps({"result": round(float(arguments.get("amount", 1) or 1) * 0.62, 2)})


def _tool_question(messages: list[dict[str, Any]], template_tools: tuple[dict, ...],
                   grammar: str | None, action: Action, max_tokens: int | None = None
                   ) -> Question:
    from engine.conversation import Question

    generation = GenerationConfig(max_tokens or action.max_tokens,
                                  sampling=chat_sampling(action), grammar=grammar)
    return Question.chat(messages, generation, tools=template_tools)


# --- the API's requests -----------------------------------------------------------------
def api_question(history: list[dict[str, Any]], action: Action, n_ctx: int,
                 syntax: ToolSyntax, prediction: str = "") -> Question:
    """``action``'s chat request as a client sends it, read by the API's own parser and
    lane: with its JSON schema (``json_schema``) or ``prediction``."""
    body: dict[str, Any] = {
        "model": "tandem", "max_tokens": action.max_tokens,
        "messages": [*history, {"role": "user", "content": action.text}],
        "context_policy": "drop_oldest",  # as the chat actions: a long chat drops turns
        "temperature": TEMPERATURE if action.seed is not None else 0.0}
    if action.seed is not None:
        body["seed"] = action.seed
    if action.kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": action.mode, "schema": SCHEMAS[action.mode][1]}}
    if prediction:
        body["prediction"] = {"type": "content", "content": prediction}
    request = parse_request(body, Limits(max_tokens=4096, n_ctx=n_ctx), True, syntax)
    return question_of(Job(request, lambda _kind, _value: None))


def prediction_text(action: Action, plain_text: str) -> str:
    """What ``action`` predicts: plain decoding's answer (right), that answer with every
    third word changed and its last line left out (perturbed), or another text."""
    if action.mode == "right":
        return plain_text
    if action.mode == "unrelated":
        return action.extra
    lines = plain_text.split("\n")
    if len(lines) > 2:
        lines = lines[:-1]
    words = "\n".join(lines).split(" ")
    return " ".join(w[::-1] + "s" if i % 3 == 1 else w for i, w in enumerate(words))
