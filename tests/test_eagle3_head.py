"""An EAGLE-3 head written for the bundled model (engine.gguf.eagle3) is the ``eagle3`` GGUF
llama.cpp loads: its keys' types, its tensors' shapes and the target's vocabulary (issue
35's first step; docs/eagle3-notes.md). Malformed weights are refused before writing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.drafters import DEFAULT_EAGLE3_HEAD
from engine.gguf.eagle3 import is_eagle3_head, shape_for_target, write_eagle3_head
from engine.runtime.native import NativeModel


def test_a_head_for_the_bundled_model_loads_in_llama_cpp(model_path: Path, tmp_path: Path):
    shape = shape_for_target(model_path)
    assert (shape.hidden, shape.n_heads, shape.n_kv_heads, shape.ffn) == (576, 9, 3, 1536)
    assert shape.target_layers == (2, 15, 27)  # llama.cpp's converter's choice for 30 layers
    fc = np.zeros((576, 3 * 576), np.float32)
    head = write_eagle3_head(tmp_path / "head.gguf", model_path, shape, {"fc.weight": fc})
    with NativeModel(head) as model:
        assert model.architecture().name == "eagle3"
        assert (model.n_vocab, model.n_embd) == (49152, 576)


def test_an_eagle3_head_is_known_by_its_header_not_its_name(model_path: Path,
                                                           tmp_path: Path) -> None:
    assert is_eagle3_head(DEFAULT_EAGLE3_HEAD)
    renamed = tmp_path / "head.bin"
    renamed.write_bytes(DEFAULT_EAGLE3_HEAD.read_bytes())
    assert is_eagle3_head(renamed)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(64))
    assert not is_eagle3_head(model_path)  # a target GGUF
    assert not is_eagle3_head(fake) and not is_eagle3_head(tmp_path / "missing.gguf")
    assert not is_eagle3_head(tmp_path)


def test_malformed_weights_are_refused_before_writing(model_path: Path, tmp_path: Path):
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match="fc.weight: shape"):
        write_eagle3_head(path, model_path, weights={"fc.weight": np.zeros((576, 576))})
    with pytest.raises(ValueError, match="not tensors of an eagle3 head"):
        write_eagle3_head(path, model_path, weights={"d2t": np.zeros(8)})
    with pytest.raises(ValueError, match="three target layers"):
        shape_for_target(model_path, (2, 15, 30))
    assert not path.exists()


def test_torch_and_llama_cpp_run_the_same_head(model_path: Path, target, tmp_path: Path):
    """The same weights both ways (training.eagle3_head in torch, the GGUF in llama.cpp,
    fed the target's real layer inputs): the first draft token agrees at >= 99% of
    positions, with a reduced vocabulary of its own (d2t)."""
    import dataclasses

    import torch

    from engine.drafters.eagle3 import Eagle3Drafter
    from models.gguf_weights import read_embeddings
    from training.eagle3_head import Eagle3Head

    shape = dataclasses.replace(shape_for_target(model_path), draft_vocab=4096)
    embed, lm_head = read_embeddings(model_path)
    torch.manual_seed(0)
    d2t = torch.randperm(49152)[:4096]
    head = Eagle3Head(shape, torch.from_numpy(embed), torch.from_numpy(lm_head), d2t)
    path = write_eagle3_head(tmp_path / "head.gguf", model_path, shape, head.gguf_weights())
    tokens = target.tokenize("The Roman Empire spanned many centuries, from its founding "
                             "to its fall, and shaped law, language and architecture across "
                             "Europe, North Africa and the Middle East. Its roads still "
                             "carry traffic; its aqueducts still stand.")
    drafter = Eagle3Drafter(path, target)
    try:
        target.reset()
        target.set_features(True)
        features = target.prefill(tokens, None).features
        n = len(tokens) - 1
        # Every entry's output at once: (token j+1, fused features of token j) at j.
        ours, _ = drafter._entries(0, features)
        batch = drafter._fresh_batch()
        for j in range(n):
            batch.add_token(tokens[j + 1], ours[j], j, output=True)
        drafter.ctx.process(batch, encode=False)
        from_llama = drafter.ctx.logits(n).argmax(-1)
    finally:
        drafter.close()
        target.set_features(False)
    with torch.no_grad():
        g = head.fuse(torch.from_numpy(features)[None])
        h, _ = head.decode(torch.tensor(tokens[1:])[None], g[:, :n], torch.arange(n))
        from_torch = head.d2t[head.logits(h)[0].argmax(-1)].numpy()
    assert set(from_llama.tolist()) <= set(d2t.tolist())  # scores only its own vocabulary
    assert (from_torch == from_llama).mean() >= 0.99, (from_torch, from_llama)
