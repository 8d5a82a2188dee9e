"""``tandem models ...`` against the local fake Hub: search, files with fit, download
with its progress bar, list, import, remove."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli.models import main
from tests.hub_server import (
    HEAD_REPO,
    TARGET_REPO,
    FakeHub,
    FakeRepo,
    standard_repos,
    write_tiny_gguf,
)


@pytest.fixture()
def hub(tmp_path_factory: pytest.TempPathFactory):
    with FakeHub(standard_repos(tmp_path_factory.mktemp("repos"))) as h:
        yield h


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    return tmp_path


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_search_and_files(hub: FakeHub, env: Path, capsys) -> None:
    rc, out, _ = run(capsys, "search", "llama", "--endpoint", hub.endpoint)
    assert rc == 0 and TARGET_REPO in out and "downloads" in out
    rc, out, _ = run(capsys, "search", "--repo", TARGET_REPO, "--endpoint", hub.endpoint)
    assert rc == 0
    assert "Q4_K_M" in out and "Q8_0" in out and "fits" in out
    assert HEAD_REPO in out and "fingerprint" in out


def test_download_list_remove(hub: FakeHub, env: Path, capsys) -> None:
    cache = str(env / "cache")
    rc, out, err = run(capsys, "download", TARGET_REPO, "Q4_K_M", "--endpoint", hub.endpoint,
                       "--cache-dir", cache)
    assert rc == 0, err
    assert f"{TARGET_REPO}:Q4_K_M ready" in out and "draft head" in out
    assert "100%" in err  # the tqdm bar
    rc, out, _ = run(capsys, "list")
    assert f"{TARGET_REPO}:Q4_K_M" in out and HEAD_REPO in out
    rc, out, _ = run(capsys, "remove", f"{TARGET_REPO}:Q4_K_M", "--cache-dir", cache,
                     "--delete-files")
    assert rc == 0 and "removed" in out
    listed = run(capsys, "list")[1]  # the bundled model is always there
    assert "no downloaded models" in listed and "SmolLM2-135M-Instruct (bundled)" in listed


def test_download_errors_are_one_line(hub: FakeHub, env: Path, capsys) -> None:
    rc, _, err = run(capsys, "download", TARGET_REPO, "Q2_K", "--endpoint", hub.endpoint,
                     "--cache-dir", str(env / "cache"))
    assert rc == 2 and "has no 'Q2_K'" in err and "Q4_K_M" in err
    hub.faults.corrupt.add("Tiny-Llama-Q8_0.gguf")
    rc, _, err = run(capsys, "download", TARGET_REPO, "Q8_0", "--head", "none",
                     "--endpoint", hub.endpoint, "--cache-dir", str(env / "cache"))
    assert rc == 2 and "sha256" in err
    assert "no downloaded models" in run(capsys, "list")[1]


def test_import(env: Path, capsys) -> None:
    path = write_tiny_gguf(env / "local-Q4_0.gguf")
    rc, out, _ = run(capsys, "import", str(path), "--name", "mine")
    assert rc == 0 and "imported mine (Q4_0" in out
    assert "mine" in run(capsys, "list")[1]
    (env / "x.txt").write_text("not a model")
    rc, _, err = run(capsys, "import", str(env / "x.txt"))
    assert rc == 2 and "not a GGUF" in err
    vocab = write_tiny_gguf(env / "vocab.gguf", vocab_only=True)
    rc, _, err = run(capsys, "import", str(vocab))
    assert rc == 2 and "vocabulary-only" in err and "Traceback" not in err
    assert "vocab" not in run(capsys, "list")[1]


@pytest.fixture()
def draft_hub(tmp_path_factory: pytest.TempPathFactory, model_path: Path):
    from tests.draft_repos import draft_repos

    with FakeHub(draft_repos(tmp_path_factory.mktemp("drafts"), model_path)) as h:
        yield h


def test_search_lists_paired_drafts_compatible_or_not(draft_hub: FakeHub, env: Path,
                                                      capsys) -> None:
    from tests.draft_repos import CATALOG_DRAFT, OTHER_DRAFT, TARGET, write_user_catalog

    write_user_catalog(env / "home")
    rc, out, err = run(capsys, "search", "--repo", TARGET, "--endpoint", draft_hub.endpoint)
    assert rc == 0, err
    table, drafts = out.split("draft models (checked")
    q8 = next(line for line in table.splitlines() if line.startswith("Q8_0"))
    q4 = next(line for line in table.splitlines() if line.startswith("Q4_K_M"))
    # The default draft for each quantization: the first compatible one that fits.
    assert f"{CATALOG_DRAFT}:Q8_0" in q8 and CATALOG_DRAFT not in q4 and q4.count(" - ") >= 1
    other = next(line for line in drafts.splitlines() if line.startswith(OTHER_DRAFT))
    assert "incompatible" in other and "vocabulary type" in other and "text of token 100" in other
    catalog = next(line for line in drafts.splitlines() if line.startswith(CATALOG_DRAFT))
    assert "compatible" in catalog and "SmolLM2" in catalog and "Q8_0" in catalog


def test_download_with_its_draft_then_list(draft_hub: FakeHub, env: Path, capsys) -> None:
    from tests.draft_repos import CATALOG_DRAFT, CATALOG_DRAFT_FILE, OTHER_DRAFT, TARGET

    cache = str(env / "cache")
    rc, _, err = run(capsys, "download", TARGET, "Q8_0", "--draft", OTHER_DRAFT,
                     "--endpoint", draft_hub.endpoint, "--cache-dir", cache)
    assert rc == 2 and "cannot draft" in err and "vocabulary type" in err
    rc, _, err = run(capsys, "download", TARGET, "Q4_K_M", "--draft", CATALOG_DRAFT,
                     "--endpoint", draft_hub.endpoint, "--cache-dir", cache)
    assert rc == 2 and "bigger than a quarter" in err
    assert "no downloaded models" in run(capsys, "list")[1]
    rc, out, err = run(capsys, "download", TARGET, "Q8_0", "--draft", "auto",
                       "--endpoint", draft_hub.endpoint, "--cache-dir", cache)
    assert rc == 0, err
    assert f"draft model: {cache}" in out and CATALOG_DRAFT_FILE in out
    assert "+ draft" in err and "100%" in err  # one bar for the one job
    rc, out, _ = run(capsys, "list")
    assert f"{CATALOG_DRAFT}/{CATALOG_DRAFT_FILE}" in out and "draft model" in out
    rc, out, _ = run(capsys, "download", TARGET, "Q4_K_M", "--draft", "none",
                     "--endpoint", draft_hub.endpoint, "--cache-dir", cache)
    line = next(x for x in run(capsys, "list")[1].splitlines() if "Q4_K_M" in x)
    assert CATALOG_DRAFT not in line


def test_search_says_a_file_drafts_with_its_own_mtp_block(tmp_path: Path, env: Path,
                                                          capsys) -> None:
    """Read from the file's header before any download: ``nextn_predict_layers``."""
    import gguf

    path = tmp_path / "Tiny-Qwen3.5-MTP-Q4_K_M.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_name("Tiny Qwen3.5 with MTP")
    w.add_block_count(3)  # two trunk layers and the next-token block
    w.add_nextn_predict_layers(1)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}".encode() for i in range(96)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    repo = "someone/Tiny-Qwen3.5-MTP-GGUF"
    with FakeHub([FakeRepo(repo, {path.name: path.read_bytes()})]) as hub:
        rc, out, _ = run(capsys, "search", "--repo", repo, "--endpoint", hub.endpoint)
    assert rc == 0
    assert "MTP block (in the model): its own next-token block, no download" in out
