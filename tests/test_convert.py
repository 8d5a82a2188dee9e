"""``tandem models convert``: the bundled model at another weight type, registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.hub.convert import ConvertError, convert, converted_path


def _tandem(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TANDEM_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def _file_type(path: Path) -> int:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.file_type"]
    return int(field.parts[field.data[0]][0])


def test_convert_to_f16_registers_a_model_that_answers(model_path, tmp_path):
    home = tmp_path / "home"
    out = _tandem("models", "convert", str(model_path), "--type", "F16", "--name", "smol-f16",
                  "--threads", "2", home=home)
    assert out.returncode == 0, out.stderr
    written = home / "models" / "SmolLM2-135M-Instruct.F16.gguf"
    assert str(written) in out.stdout and written.is_file()
    assert _file_type(written) == 1  # LLAMA_FTYPE_MOSTLY_F16
    assert not list((home / "models").glob("*.part"))
    listed = json.loads((home / "models" / "models.json").read_text())
    assert [(m["name"], m["quant"], m["source"]) for m in listed] == [
        ("smol-f16", "F16", "convert")]
    answer = _tandem("generate", "--model", str(written), "--prompt", "Name a fruit.",
                     "--max-tokens", "8", "--drafter", "none", "--threads", "2", "--json",
                     home=home)
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["tokens"]
    removed = _tandem("models", "remove", "smol-f16", "--delete-files", home=home)
    assert removed.returncode == 0, removed.stderr
    assert not written.exists()  # Tandem wrote it, so Tandem may delete it


def test_refusals_name_the_problem_and_leave_nothing(model_path, tmp_path):
    dst = converted_path(model_path, "f32", tmp_path)
    assert dst.name == "SmolLM2-135M-Instruct.F32.gguf"
    with pytest.raises(ConvertError, match="choose one of f32, f16, bf16, q8_0, q4_0"):
        convert(model_path, dst, "f8", 2)
    with pytest.raises(ConvertError, match=r"needs about 5\d\d\.\d MiB .* has 1000 B free"):
        convert(model_path, dst, "f32", 2, free_bytes=1000)
    with pytest.raises(ConvertError, match="is the source itself"):
        convert(model_path, model_path, "q4_0", 2)
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("not a model")
    with pytest.raises(ModelLoadError):
        convert(not_gguf, tmp_path / "out.gguf", "f16", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.gguf"]


def test_cli_refusals_are_one_line(tandem_home, tmp_path):
    home = tmp_path / "home"
    bad_type = _tandem("models", "convert", "--type", "f8", home=home)
    assert bad_type.returncode == 2 and "choose one of f32" in bad_type.stderr
    unknown = _tandem("models", "convert", "nowhere", "--type", "f16", home=home)
    assert unknown.returncode == 2
    assert "neither a GGUF file nor a local model" in unknown.stderr
