"""How well the loaded model can use tools, in words for Settings > Tools: the syntax it
is offered them in (its chat template's own, or the generic one), and for a small model
that it calls them unreliably, with a model that fits this machine and calls them."""

from __future__ import annotations

# Under about 1B parameters at 4-5 bits a weight: such models rarely pick the right tool
# or write its arguments (the bundled SmolLM2-135M among them).
SMALL_MODEL_BYTES = 700_000_000

SYNTAX_WORDS = {
    "hermes": "its chat template's own syntax (Hermes <tool_call> blocks)",
    "llama3": "its chat template's own syntax (Llama 3 JSON calls)",
    "generic": "Tandem's generic syntax (a JSON object the system message describes): "
               "its chat template has no tool syntax",
}


def tool_support_note(syntax: str, model_bytes: int, model_name: str,
                      suggestion: str | None) -> str:
    """``suggestion``: a model that fits here and calls tools (described), None if none."""
    note = f"{model_name} is offered tools in {SYNTAX_WORDS.get(syntax, syntax)}."
    if model_bytes < SMALL_MODEL_BYTES:
        note += (" It is a small model: it often calls the wrong tool or none, so "
                 "'Every answer calls a tool' helps.")
        if suggestion:
            note += f" For tools, try {suggestion}."
    return note
