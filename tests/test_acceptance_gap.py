"""training.acceptance_gap: its teacher-forced score is the training eval's metric, and
the real drafter's first guesses line up with it position by position."""

from __future__ import annotations

import numpy as np

from engine.drafters import make_drafter
from tests.conftest import pick_per_category

MAX_TOKENS = 24


def test_teacher_forced_score_is_the_training_eval_metric(target, dev_prompts):
    from training.acceptance_gap import SourceReport, _greedy, measure
    from training.distill_data import Sample
    from training.train_head import TrainConfig, evaluate

    # Float weights, as training evaluates (int8 quantizes each call's activations with
    # their own range, so a padded training batch would round differently).
    drafter = make_drafter("head", target=target, mode="chain", depth=1, weights="float")
    rows = pick_per_category(dev_prompts, 1)[:2]
    report = SourceReport()
    samples = []
    for row in rows:
        text = _greedy(target, "dev", [{"role": "user", "content": row["turns"][0]}],
                       MAX_TOKENS)
        measure(target, drafter, text, report)
        # The same text as a training sample (features of one prefill; the last token's
        # successor is unknown, so it carries no weight).
        full = text.prompt + text.answer
        target.reset()
        target.set_features(True)
        feats = target.prefill(full, feature_tail=None).features
        answer = np.zeros(len(full), bool)
        answer[len(text.prompt):-1] = True
        samples.append(Sample(np.asarray(full, np.int32), answer, feats,
                              np.asarray(full[1:] + [-1], np.int32)))
    target.set_features(False)

    n_scored = sum(len(s.tokens) - int(np.argmax(s.answer)) - 1 for s in samples)
    assert report.teacher_full.total == n_scored
    ev = evaluate(drafter.head, samples, TrainConfig(unroll=1, bf16=False, max_len=4096))
    assert abs(ev["accuracy_by_depth"][0] - report.teacher_full.rate) < 1e-9
    # The drafter drafted at every step, and its first guess is the teacher-forced one
    # (features from verification batches may flip a rare near-tie).
    assert report.engine_first.total >= MAX_TOKENS // 2
    assert report.engine_equals_teacher.rate >= 0.85
