"""Training prompts of the benchmark's task types, and going on training a saved head."""

from __future__ import annotations

import pytest
import torch

from training.sharegpt import Conversation
from training.task_prompts import MAX_SOURCE_WORDS, TASKS, task_conversations


def _conv(i: int, n_words: int) -> Conversation:
    answer = "\n".join(f"word{j}" for j in range(n_words))  # one word per line
    return Conversation(str(i), ({"role": "user", "content": f"question {i}?"},
                                 {"role": "assistant", "content": answer}))


def test_tasks_come_in_turn_around_plain_exchanges():
    convs = [_conv(i, 80) for i in range(2 * len(TASKS))]
    out = list(task_conversations(iter(convs)))
    assert len(out) == len(convs)
    assert out[0] == convs[0] and out[len(TASKS)] == convs[len(TASKS)]  # kept as they were
    for k, conv in enumerate(out):
        user, answer = conv.first_exchange()
        assert answer == convs[k].first_exchange()[1]  # the source answer, replaced later
        if TASKS[k % len(TASKS)] is not None:
            assert "word0\nword1" in user  # the text with its own line breaks
            assert user.startswith(TASKS[k % len(TASKS)].split("{")[0].strip())
    assert "question 3?" in out[3].first_exchange()[0]  # answer-from-text asks its question


def test_short_answers_wait_and_long_ones_are_cut_after_a_word():
    convs = [_conv(0, 80), _conv(1, 10), _conv(2, 2 * MAX_SOURCE_WORDS)]
    out = list(task_conversations(iter(convs)))
    assert [c.id for c in out] == ["0", "2:task1"]  # the 10-word answer is no source
    text = out[1].first_exchange()[0]
    assert text.endswith(f"word{MAX_SOURCE_WORDS - 1}")


def test_training_goes_on_from_a_saved_head_of_the_same_shape(tmp_path):
    from models.draft_head import DraftHead
    from models.head_config import HeadConfig, TargetFingerprint
    from models.head_io import save_head
    from training.train_draft import _initial_head

    fp = TargetFingerprint(vocab_size=50, hidden_size=32, tokenizer_sha256="abc")
    cfg = HeadConfig(hidden_size=32, n_heads=4, n_kv_heads=2, intermediate_size=64,
                     draft_vocab_size=25, target=fp)
    embed = torch.randn(50, 32)
    saved = DraftHead(cfg, embed, embed.clone(), torch.arange(0, 50, 2))
    save_head(saved, tmp_path / "head")
    again = _initial_head(tmp_path / "head", cfg, embed, embed.clone())
    assert again.training and torch.equal(again.d2t, saved.d2t)
    torch.testing.assert_close(again.fusion.w1.weight, saved.fusion.w1.weight.half().float())
    other = HeadConfig(**{**cfg.__dict__, "n_layers": 2})
    with pytest.raises(ValueError, match="n_layers"):
        _initial_head(tmp_path / "head", other, embed, embed.clone())
