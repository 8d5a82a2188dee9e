"""An EAGLE-3 head written for the bundled model (engine.gguf.eagle3) is the ``eagle3`` GGUF
llama.cpp loads: its keys' types, its tensors' shapes and the target's vocabulary (issue
35's first step; docs/eagle3-notes.md). Malformed weights are refused before writing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.gguf.eagle3 import shape_for_target, write_eagle3_head
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


def test_malformed_weights_are_refused_before_writing(model_path: Path, tmp_path: Path):
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match="fc.weight: shape"):
        write_eagle3_head(path, model_path, weights={"fc.weight": np.zeros((576, 576))})
    with pytest.raises(ValueError, match="not tensors of an eagle3 head"):
        write_eagle3_head(path, model_path, weights={"d2t": np.zeros(8)})
    with pytest.raises(ValueError, match="three target layers"):
        shape_for_target(model_path, (2, 15, 30))
    assert not path.exists()
