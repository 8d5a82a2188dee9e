"""What each model can draft with (engine.planning.drafter_options), as the GUI's drafter
selector and ``tandem models drafters`` list it: real GGUF headers and vocabularies of
the bundled model and synthetic models of other architectures (issue 35, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli.models import main
from engine.drafters import DEFAULT_EAGLE3_HEAD
from engine.gguf.architectures import TinyShape, write_architecture_gguf
from engine.gguf.header import read_file_facts
from engine.planning.drafter_options import drafter_options, mtp_option
from engine.runtime.model_info import read_model_info


@pytest.fixture(scope="module")
def synthetic(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("options")
    small = TinyShape(hidden=128, n_layers=2, ffn=256, ssm_state=32)
    return {
        "qwen35-mtp": write_architecture_gguf("qwen35", folder / "qwen35-mtp.gguf", model_path,
                                              TinyShape(hidden=128, n_layers=2, ffn=256,
                                                        ssm_state=32, mtp_layers=1)),
        "gemma3": write_architecture_gguf("gemma3", folder / "gemma3.gguf", model_path, small),
        "mamba": write_architecture_gguf("mamba", folder / "mamba.gguf", model_path, small),
    }


def _by_name(path: Path, **kwargs) -> dict:  # noqa: ANN003
    return {o.drafter: o for o in drafter_options(read_model_info(path), **kwargs)}


def test_the_bundled_model_offers_its_heads_and_says_why_not_mtp(model_path: Path):
    options = _by_name(model_path)
    assert options["memory"].available and options["lookup"].available
    assert options["head"].available  # the bundled torch head
    assert options["eagle3"].available and "head.gguf" in options["eagle3"].detail
    assert not options["mtp"].available
    assert "no next-token" in options["mtp"].detail
    # No other GGUF here drafts for it: said, with where to find one.
    assert not options["draft"].available and "search" in options["draft"].detail


def test_a_file_with_an_mtp_block_offers_it_from_its_header(synthetic):
    facts = read_file_facts(synthetic["qwen35-mtp"])
    assert facts.mtp_layers == 1 and facts.n_layers == 2  # the trunk, without the block
    assert mtp_option(facts).available
    options = _by_name(synthetic["qwen35-mtp"])
    assert options["mtp"].available
    # The bundled EAGLE-3 head is another model's: not offered, and, named, why not.
    assert not options["eagle3"].available and "no EAGLE-3 head" in options["eagle3"].detail
    named = _by_name(synthetic["qwen35-mtp"], eagle3_heads=[DEFAULT_EAGLE3_HEAD])
    assert "hidden size: the draft has 576, the target 128" in named["eagle3"].detail
    assert not options["head"].available


def test_why_each_is_not_offered_on_other_architectures(synthetic):
    gemma = _by_name(synthetic["gemma3"])
    assert "cannot export the layer inputs" in gemma["eagle3"].detail
    assert not gemma["mtp"].available
    mamba = _by_name(synthetic["mamba"])
    # A recurrent model without state snapshots: nothing can be drafted, each says why.
    assert not any(o.available for o in mamba.values())
    assert all("recurrent" in o.detail for o in mamba.values())


def test_tandem_models_drafters_lists_them(synthetic, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    assert main(["drafters", str(synthetic["qwen35-mtp"])]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[3:] if line.strip()}
    assert lines["mtp"].split()[1] == "yes"
    assert lines["eagle3"].split()[1] == "no"
