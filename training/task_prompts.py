"""Training prompts of the benchmark's task types, made from ShareGPT text.

The head learns what the target writes after the prompts it is trained on. ShareGPT's
first turns are mostly open questions, while Spec-Bench also asks to summarize a
document, extract from it, answer from retrieved text and rewrite: answers that copy
from the prompt, where the bundled head is weakest (first-token accuracy 0.24 on
summarization, 0.37 on all dev prompts against 0.47 on ShareGPT; README). These prompts
wrap ShareGPT answers in such tasks (never the benchmark's own prompts); the target
still writes every answer (self-distillation). One conversation in ``len(TASKS)`` stays
as it was, so the original distribution is kept.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from training.sharegpt import Conversation

MAX_SOURCE_WORDS = 260  # keeps a wrapped text within a 640-token prompt

TASKS: tuple[str | None, ...] = (
    None,  # the exchange as it is
    "Summarize the following text in a few sentences.\n\n{text}",
    "Extract the key facts from the following text as a short bulleted list.\n\n{text}",
    "Read the text below and answer the question.\n\nText: {text}\n\nQuestion: {question}",
    "Rewrite the following text so that it is clearer and more concise.\n\n{text}",
)


def task_conversations(conversations: Iterator[Conversation],
                       min_source_words: int = 60) -> Iterator[Conversation]:
    """One conversation per usable input: its exchange, or a task over its answer (in
    turn). The assistant message is the source answer (self-distillation replaces it)."""
    k = 0
    for conv in conversations:
        pair = conv.first_exchange()
        if pair is None:
            continue
        question, answer = pair
        words = list(re.finditer(r"\S+", answer))
        task = k % len(TASKS)
        template = TASKS[task]
        if template is not None and len(words) < min_source_words:
            continue  # too short to summarize or extract from: wait for a longer one
        k += 1
        if template is None:
            yield conv
            continue
        # Cut after a whole word, the text's own line breaks kept (code stays code).
        text = answer[:words[MAX_SOURCE_WORDS - 1].end()] if len(
            words) > MAX_SOURCE_WORDS else answer
        prompt = template.format(text=text, question=question.strip()[:400])
        yield Conversation(f"{conv.id}:task{task}",
                           ({"role": "user", "content": prompt},
                            {"role": "assistant", "content": answer}))
