"""Training an EAGLE-3 head (training.train_eagle3) on real layer-input features of the
bundled model: the loss falls, a stopped run resumes from its checkpoint, and the trained
head is written as an eagle3 GGUF (Q8_0 matrices) that llama.cpp loads for the target."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.gguf.eagle3 import shape_for_target
from engine.runtime.native import NativeModel
from models.gguf_weights import read_embeddings
from training.distill_data import BuildConfig, FeatureExtractor
from training.train_eagle3 import Eagle3TrainConfig, export, new_head, train

TEXTS = [("Name three primary colours.", "Red, yellow and blue are the three primary "
          "colours; mixing them gives the others."),
         ("What is the capital of France?", "The capital of France is Paris, on the Seine.")]


@pytest.mark.slow
def test_an_eagle3_head_trains_resumes_and_exports(model_path: Path, tmp_path: Path):
    layers = (2, 15, 27)
    extractor = FeatureExtractor(model_path, BuildConfig(
        answers="dataset", max_prompt_tokens=64, max_answer_tokens=48, n_parallel=1,
        feature_layers=layers))
    try:
        samples = [extractor.dataset_sample(user, answer) for user, answer in TEXTS]
    finally:
        extractor.close()
    assert all(s is not None and s.features.shape[1] == 3 * 576 for s in samples)
    shape = dataclasses.replace(shape_for_target(model_path, layers), draft_vocab=512)
    embed, lm_head = read_embeddings(model_path)
    answer_ids = np.unique(np.concatenate([s.target_next for s in samples]))  # type: ignore[union-attr]
    rest = np.setdiff1d(np.arange(512), answer_ids)
    d2t = torch.from_numpy(np.concatenate([answer_ids, rest])[:512])
    head = new_head(shape, embed, lm_head, d2t)
    losses: list[float] = []
    cfg = Eagle3TrainConfig(steps=30, seqs_per_step=2, max_len=96, lr=3e-3, warmup=5)
    state = train(head, samples, embed.shape[0], cfg, tmp_path / "run",  # type: ignore[arg-type]
                  lambda _step, m: losses.append(m["loss"]))
    assert state.step == 30 and losses[-1] < 0.5 * losses[0]
    again = new_head(shape, embed, lm_head, d2t)
    state = train(again, samples, embed.shape[0], dataclasses.replace(cfg, steps=32),  # type: ignore[arg-type]
                  tmp_path / "run")
    assert state.step == 32  # went on from the checkpoint's 30
    path = export(again, tmp_path / "head.gguf", model_path)
    with NativeModel(path) as model:
        assert model.architecture().name == "eagle3"
        assert model.target_layer_ids() == layers


def test_tandem_train_draft_writes_an_eagle3_head(model_path: Path, tmp_path: Path, capsys):
    """The CLI end to end on a tiny JSONL of conversations: features of the three layers
    llama.cpp's converter picks, a few steps, a report and a head.gguf llama.cpp loads."""
    import json

    from app.cli import main

    lines = [json.dumps({"conversations": [{"from": "human", "value": user},
                                           {"from": "gpt", "value": answer}]})
             for user, answer in TEXTS * 2]
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("\n".join(lines))
    out = tmp_path / "head"
    rc = main(["train-draft", "--fusion", "eagle3", "--target", str(model_path),
               "--out", str(out), "--work-dir", str(tmp_path / "work"),
               "--conversations-file", str(conversations), "--answers", "dataset",
               "--conversations", "3", "--eval-conversations", "1", "--steps", "3",
               "--draft-vocab", "1024", "--max-answer-tokens", "24", "--parallel", "1",
               "--device", "cpu"])
    assert rc == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["train"]["steps_done"] == 3 and report["head"]["draft_vocab"] == 1024
    assert report["head"]["target_layers"] == [2, 15, 27]
    with NativeModel(out / "head.gguf") as model:
        assert model.target_layer_ids() == (2, 15, 27)
    assert '"accuracy_by_depth"' in capsys.readouterr().out
