"""The EAGLE-3 head catalog (engine.hub.eagle3_catalog) against a local stand-in for the
Hub: a target finds its family's public heads by repository id or header, each head's
config.json is checked against the target's header before any download (width,
vocabulary, tapped layers), the wizard and `tandem models search --repo` say which fits
and why the others do not, and `tandem models get-eagle3` downloads a fitting head and
writes the GGUF auto then weighs (issue 35, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.hub.draft_catalog import DraftPair
from engine.hub.eagle3_catalog import (
    KNOWN_EAGLE3_HEADS,
    config_fit,
    eagle3_offers,
    eagle3_summary,
    load_eagle3_catalog,
)
from engine.hub.fit import MachineMemory
from engine.hub.repo_pairing import pair_repo
from tests.hub_server import FakeHub, FakeRepo
from tests.test_eagle3_import import _hf_checkpoint, weights_and_shape  # noqa: F401

FITS = "AngelSlim/Qwen3-8B_eagle3"
WIDE = "RedHatAI/Qwen3-8B-speculator.eagle3"


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture()
def hub(model_path: Path, tmp_path: Path, weights_and_shape):  # noqa: F811
    """A Qwen3-8B-named repository holding the bundled model, a head that fits it and one
    made for a wider target."""
    weights, shape = weights_and_shape
    fits = _hf_checkpoint(tmp_path / "fits", weights, shape)
    wide = _hf_checkpoint(tmp_path / "wide", weights, shape, target_hidden_size=4096)
    repos = [FakeRepo("someone/Qwen3-8B-Instruct-GGUF",
                      {"smollm2-as-qwen3-8b-Q4_0.gguf": model_path.read_bytes()}),
             FakeRepo(FITS, _folder_files(fits), tags=["eagle3"]),
             FakeRepo(WIDE, _folder_files(wide), tags=["eagle3"])]
    with FakeHub(repos) as server:
        yield server


def test_config_fit_says_why():
    from engine.gguf.header import GGUFFacts

    target = GGUFFacts("qwen3", 36, 4096, 32, 8, 128, 128, 40960, 151936, "Qwen3 8B")
    good = {"hidden_size": 4096, "target_hidden_size": 4096, "vocab_size": 151936,
            "draft_vocab_size": 32000, "eagle_aux_hidden_state_layer_ids": [1, 17, 32]}
    assert config_fit(good, target) == (True, "width 4096, vocabulary 151936, drafts from "
                                              "32000 tokens")
    assert "width 2048" in config_fit({**good, "target_hidden_size": 2048}, target)[1]
    assert "128256-token" in config_fit({**good, "vocab_size": 128256}, target)[1]
    assert "taps layer 40" in config_fit(
        {**good, "eagle_aux_hidden_state_layer_ids": [1, 2, 40]}, target)[1]
    assert "norm_before_fc" in config_fit({**good, "norm_before_fc": True}, target)[1]
    assert not config_fit({"hidden_size": 4096}, target)[0]  # not an EAGLE-3 config


def test_the_catalog_matches_families_by_repo_and_header():
    def heads(repo: str) -> list[str]:
        from engine.hub.draft_catalog import matching_pairs

        return [p.draft_repo for p in matching_pairs(repo, None, KNOWN_EAGLE3_HEADS)]

    assert heads("bartowski/Qwen3-8B-GGUF") == [FITS, WIDE]
    assert heads("unsloth/Meta-Llama-3.1-8B-Instruct-GGUF")[0] == \
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert heads("x/Qwen3-30B-A3B-GGUF") == ["AngelSlim/Qwen3-a3B_eagle3"]
    assert heads("x/Qwen3-14B-GGUF") == ["AngelSlim/Qwen3-14B_eagle3"]
    assert heads("x/Qwen2.5-7B-Instruct-GGUF") == [] and heads("x/gemma-3-4b-it-GGUF") == []


def test_offers_are_checked_before_download_and_the_wizard_says_which_fits(
        hub: FakeHub, model_path: Path):
    pairing = pair_repo("someone/Qwen3-8B-Instruct-GGUF", 1024,
                        MachineMemory(8 << 30, 6 << 30), endpoint=hub.endpoint)
    offers = list(pairing.eagle3)
    assert [(o.repo_id, o.fits) for o in offers] == [(FITS, True), (WIDE, False)]
    assert "width 4096, this one's is 576" in offers[1].verdict
    summary = eagle3_summary(offers)
    assert summary.startswith(f"EAGLE-3 head: {FITS} fits") and "get-eagle3" in summary
    # Only configs were fetched: no safetensors before the user asks.
    assert not hub.file_gets("model.safetensors")
    assert "none known" in eagle3_summary([])
    assert "none fits" in eagle3_summary(offers[1:])


def test_get_eagle3_downloads_a_fitting_head_and_auto_finds_it(
        hub: FakeHub, model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture):
    from app.cli.models import main
    from engine.planning.drafter_options import find_eagle3_head
    from engine.runtime.model_info import read_model_info

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    common = ["--endpoint", hub.endpoint, "--cache-dir", str(tmp_path / "hf")]
    assert main(["get-eagle3", WIDE, "--model", str(model_path), *common]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["get-eagle3", FITS, "--model", str(model_path), *common]) == 0
    written = tmp_path / "home" / "heads" / "AngelSlim--Qwen3-8B_eagle3.eagle3.gguf"
    assert written.is_file() and str(written) in capsys.readouterr().out
    assert find_eagle3_head(read_model_info(model_path))[0] == written


def test_the_users_catalog_file_adds_heads(tmp_path: Path):
    (tmp_path / "eagle3_catalog.json").write_text(json.dumps([
        {"target_pattern": "*mymodel*", "draft_repo": "me/mymodel-eagle3"}]))
    catalog = load_eagle3_catalog(tmp_path)
    assert catalog[0] == DraftPair("user", "*mymodel*", "me/mymodel-eagle3")
    assert eagle3_offers("x/mymodel-GGUF", None, catalog=catalog[:1],
                         endpoint="http://127.0.0.1:9")[0].fits is None  # unreachable: said
