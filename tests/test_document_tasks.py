"""The bench's document tasks: built from files every machine has, of the sizes asked."""

from __future__ import annotations

from app.benchmarks.bench import PREDICTING, parse_drafter_list, parse_runner_spec
from app.benchmarks.document_tasks import code_edit_prompts, cut_to_tokens, document_prompts


def _count(text: str) -> int:
    return len(text) // 4


def test_documents_of_each_size_with_each_task_and_code_edits_with_predictions():
    prompts = document_prompts(_count)
    categories = {p.category for p in prompts}
    assert {"doc-qa", "doc-extract", "doc-summary", "code-edit"} <= categories
    sizes = {p.question_id.rsplit("@", 1)[1] for p in prompts if "@" in str(p.question_id)}
    assert {"1000", "3000", "7000"} <= sizes
    for p in prompts:
        assert '<document name="' in p.turns[0]  # as the window gives an attached file
        if p.category == "code-edit":
            assert p.prediction and p.prediction in p.turns[0]
            assert 200 <= p.prediction.count("\n") <= 600
        else:
            assert p.prediction is None
    assert [p.question_id for p in document_prompts(_count)] == [p.question_id for p in prompts]


def test_a_document_is_cut_at_a_paragraph_within_the_size():
    text = "\n\n".join(f"paragraph {i} " + "word " * 50 for i in range(100))
    cut = cut_to_tokens(text, 500, _count)
    assert _count(cut) <= 500 and text.startswith(cut) and cut.endswith("word ")
    assert len(code_edit_prompts()) == 3


def test_runner_specs_that_send_predictions():
    assert parse_runner_spec("auto" + PREDICTING)[0] == "auto"
    assert parse_drafter_list("none,auto+prediction", ["none", "auto"]) == [
        "none", "auto+prediction"]
