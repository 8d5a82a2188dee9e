"""GBNF for JSON answers: any JSON object (OpenAI's ``json_object``) or one that matches a
JSON schema (``json_schema``), written by llama-cpp-python's converter (the one
llama-server's is ported from)."""

from __future__ import annotations

import json
import re
from typing import Any

from engine.errors import InvalidSamplingError
from engine.runtime.native import json_object_gbnf, json_schema_gbnf

# A schema's grammar is parsed for every answer; past this it is not a schema people send.
MAX_GRAMMAR_CHARS = 200_000
_COMPACT = re.compile(r"^space ::= .*$", re.MULTILINE)


def json_object_grammar() -> str:
    return json_object_gbnf()


def json_schema_grammar(schema: Any, setting: str = "response_format") -> str:
    """The grammar of JSON values matching ``schema`` (a parsed JSON schema). Raises
    InvalidSamplingError naming ``setting`` when the converter cannot take it (remote
    references, unknown types...)."""
    if not isinstance(schema, dict):
        raise InvalidSamplingError(setting, "the JSON schema must be an object", schema)
    try:
        gbnf = json_schema_gbnf(json.dumps(schema))
    except (AssertionError, KeyError, TypeError, ValueError, NotImplementedError,
            RecursionError) as exc:
        why = str(exc) or type(exc).__name__
        raise InvalidSamplingError(setting, f"cannot use this JSON schema ({why})",
                                   json.dumps(schema)[:200]) from None
    # Compact JSON: the converter lets a space follow every token, and where the grammar
    # leaves no choice (a key and its punctuation after a value) the text is drafted
    # whole (engine.decoding.generation: forced drafts); an optional space is a choice.
    gbnf = _COMPACT.sub('space ::= ""', gbnf)
    # JSON strings hold no raw control characters (the converter lets them through).
    gbnf = gbnf.replace(r'char ::= [^"\\]', r'char ::= [^"\\\x7F\x00-\x1F]')
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise InvalidSamplingError(setting, "the JSON schema makes a grammar of more than "
                                   f"{MAX_GRAMMAR_CHARS} characters", len(gbnf))
    return gbnf


def json_schema_text_grammar(text: str, setting: str) -> str:
    """``json_schema_grammar`` of a schema given as JSON text (a file, a settings box);
    InvalidSamplingError naming ``setting`` when the text is not JSON."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidSamplingError(setting, f"is not JSON ({exc})", text[:80]) from None
    return json_schema_grammar(schema, setting)
