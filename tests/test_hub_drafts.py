"""Pairing draft models with targets against the local fake Hub: the catalog (by repo
name and by header), remote headers read in growing ranges (and one cut short), the
vocabulary check before any download, the quarter-size rule, local GGUFs as drafts,
the fit with the draft, and target + draft downloaded as one job and registered."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from engine.gguf.header import GGUFFacts
from engine.gguf.vocab_header import read_file_vocab
from engine.hub.download import Downloader
from engine.hub.draft_catalog import KNOWN_DRAFTS, load_draft_catalog, matching_pairs
from engine.hub.draft_pairing import (
    BUNDLED_DRAFT_FILE,
    compatible_local_drafts,
    draft_limit,
    local_candidates,
)
from engine.hub.fit import MachineMemory
from engine.hub.install import install, job_items
from engine.hub.local_models import LocalModel, ModelRegistry
from engine.hub.remote_header import read_remote_header
from engine.hub.repo_pairing import pair_repo
from engine.hub.search import list_repo
from tests.draft_repos import (
    BY_HEADER,
    CATALOG_DRAFT,
    CATALOG_DRAFT_FILE,
    OTHER_DRAFT,
    TARGET,
    TARGET_Q4,
    TARGET_Q8,
    draft_repos,
    write_user_catalog,
)
from tests.hub_server import FakeHub
from tests.vocab_gguf import other_vocab, write_vocab_gguf

GiB = 2**30
MEMORY = MachineMemory(16 * GiB, 8 * GiB, None)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory, model_path: Path):
    return draft_repos(tmp_path_factory.mktemp("draft-repos"), model_path)


@pytest.fixture()
def hub(repos):
    with FakeHub(repos) as h:
        yield h


@pytest.fixture()
def registry(tmp_path: Path) -> ModelRegistry:
    return ModelRegistry(tmp_path / "home" / "models" / "models.json")


def _facts(arch: str, name: str) -> GGUFFacts:
    return GGUFFacts(arch, None, None, None, None, None, None, None, None, name)


@pytest.mark.parametrize(("repo", "arch", "name", "draft"), [
    ("bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", None, None,
     "bartowski/Llama-3.2-1B-Instruct-GGUF"),
    ("me/renamed", "llama", "Meta Llama 3.1 70B Instruct",
     "bartowski/Llama-3.2-1B-Instruct-GGUF"),
    ("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF", None, None,
     "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"),  # the Coder draft comes first
    ("me/x", "qwen2", "Qwen2.5 14B Instruct", "Qwen/Qwen2.5-0.5B-Instruct-GGUF"),
    ("unsloth/Qwen3-30B-A3B-GGUF", None, None, "Qwen/Qwen3-0.6B-GGUF"),
    ("me/y", "qwen3moe", "Qwen3 30B A3B", "Qwen/Qwen3-0.6B-GGUF"),
    ("ggml-org/gemma-3-12b-it-GGUF", None, None, "unsloth/gemma-3-270m-it-GGUF"),
    ("me/z", "llama", "SmolLM2 1.7B Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct-GGUF"),
])
def test_catalog_matches_by_repo_or_header(repo: str, arch: str | None, name: str | None,
                                           draft: str) -> None:
    facts = _facts(arch, name) if arch else None
    pairs = matching_pairs(repo, facts)
    assert pairs and pairs[0].draft_repo == draft
    assert len({p.draft_repo for p in pairs}) == len(pairs)


@pytest.mark.parametrize(("repo", "arch", "name"), [
    ("unsloth/Qwen3.5-9B-GGUF", "qwen35", "Qwen3.5 9B"),  # another vocabulary
    ("unsloth/gemma-3n-E4B-it-GGUF", "gemma3n", "Gemma 3n E4B It"),
    ("me/mistral", "llama", "Mistral 7B Instruct v0.3"),
    ("TheBloke/TinyLlama-1.1B-Chat-GGUF", "llama", "TinyLlama 1.1B Chat"),
    ("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2", "Qwen2.5 0.5B Instruct"),
])
def test_catalog_leaves_other_families_alone(repo: str, arch: str, name: str) -> None:
    drafts = [p.draft_repo for p in matching_pairs(repo, _facts(arch, name))]
    assert repo not in drafts  # never a repository as its own draft
    if not repo.startswith("Qwen/Qwen2.5"):
        assert drafts == []


def test_user_catalog_comes_first_and_a_broken_one_is_skipped(tmp_path: Path) -> None:
    write_user_catalog(tmp_path)
    pairs = load_draft_catalog(tmp_path)
    assert pairs[0].draft_repo == OTHER_DRAFT and pairs[1:] == KNOWN_DRAFTS
    (tmp_path / "draft_catalog.json").write_text("[{\"target_pattern\": 1}]")
    assert load_draft_catalog(tmp_path) == KNOWN_DRAFTS


def test_remote_header_reads_the_token_list_in_growing_ranges(hub: FakeHub) -> None:
    choice = next(c for c in list_repo(TARGET, endpoint=hub.endpoint).gguf_choices()
                  if c.quant == "Q8_0")
    header = read_remote_header(choice, endpoint=hub.endpoint)
    assert header is not None and header.complete
    local = read_file_vocab(_local_copy(hub, TARGET, TARGET_Q8))
    assert header.vocab is not None and header.vocab.texts == local.texts  # type: ignore[union-attr]
    assert (header.vocab.vocab_type, header.vocab.bos_id) == ("BPE", 1)
    # The ~1.7 MB tokenizer needed a second, longer range, not the 14 MB file.
    assert hub.file_gets(TARGET_Q8) == ["bytes=0-524287", "bytes=524288-4194303"]
    assert header.facts.architecture == "llama" and header.facts.vocab_size == 49152


def test_a_header_cut_by_the_cap_says_what_was_not_checked(hub: FakeHub) -> None:
    pairing = pair_repo(TARGET, 4096, MEMORY, endpoint=hub.endpoint,
                        max_header_bytes=300_000)
    draft = next(r for r in pairing.remote if r.pair.draft_repo == CATALOG_DRAFT)
    assert pairing.header is not None and not pairing.header.complete
    assert draft.check.compatible and not draft.check.confirmed
    assert "token texts from id" in draft.check.verdict
    assert "not fully checked" in draft.check.verdict


def _local_copy(hub: FakeHub, repo: str, name: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / name
    path.write_bytes(hub.repos[repo].files[name])
    return path


def test_pairing_checks_vocabularies_and_sizes(hub: FakeHub, registry: ModelRegistry,
                                               model_path: Path, tmp_path: Path) -> None:
    data_dir = registry.path.parent.parent
    write_user_catalog(data_dir)
    local = write_vocab_gguf(tmp_path / "local-draft.gguf", model_path, name="local")
    registry.add(LocalModel("local-draft", str(local), "import", local.stat().st_size,
                            "F32"))
    pairing = pair_repo(TARGET, 4096, MEMORY, draft_catalog=load_draft_catalog(data_dir),
                        registry=registry, endpoint=hub.endpoint)
    checks = {r.pair.draft_repo: r.check for r in pairing.remote}
    # The catalog's other SmolLM2 draft is not on this Hub: left out, not an error.
    assert set(checks) == {OTHER_DRAFT, CATALOG_DRAFT}
    assert checks[CATALOG_DRAFT].confirmed
    assert not checks[OTHER_DRAFT].compatible
    assert {p[0] for p in checks[OTHER_DRAFT].problems} == {"vocabulary type",
                                                            "text of token 100"}
    assert "incompatible (vocabulary type" in checks[OTHER_DRAFT].verdict
    rows = {r.choice.quant: r for r in pairing.rows}
    q8, q4 = rows["Q8_0"], rows["Q4_K_M"]
    # Local first (nothing to download), then the catalog's; the 3 MB draft is over a
    # quarter of the 7.7 MB Q4_K_M, so only the Q8_0 gets it.
    assert [o.label for o in q8.drafts] == ["local-draft", f"{OTHER_DRAFT}:Q8_0",
                                            f"{CATALOG_DRAFT}:Q8_0"]
    assert [o.label for o in q4.drafts] == ["local-draft", f"{OTHER_DRAFT}:Q8_0"]
    assert all(o.n_bytes <= draft_limit(r.choice.n_bytes) for r in pairing.rows
               for o in r.drafts)
    assert q8.default_draft is not None and q8.default_draft.path == str(local)
    assert q8.default_draft.download_bytes == 0
    # The fit counts the draft's weights and its own KV cache (its header's shape).
    assert q8.fit.n_draft_bytes > local.stat().st_size
    catalog = next(o for o in q8.drafts if o.choice is not None and o.check.compatible)
    with_catalog = pairing.fit(q8.choice, None, catalog)
    alone = pairing.fit(q8.choice, None, None)
    assert with_catalog.n_total_bytes - alone.n_total_bytes == with_catalog.n_draft_bytes
    assert with_catalog.n_draft_bytes > catalog.n_bytes


def test_pairing_by_header_when_the_name_says_nothing(hub: FakeHub) -> None:
    pairing = pair_repo(BY_HEADER, 4096, MEMORY, endpoint=hub.endpoint)
    assert [r.pair.draft_repo for r in pairing.remote] == [CATALOG_DRAFT]
    assert pairing.rows[0].default_draft is not None
    assert pairing.rows[0].default_draft.label == f"{CATALOG_DRAFT}:Q8_0"


def test_local_drafts_for_a_local_target(model_path: Path, f32_model_path: Path,
                                         tmp_path: Path, registry: ModelRegistry) -> None:
    other = write_vocab_gguf(tmp_path / "other.gguf", model_path, edit=other_vocab)
    bundled = registry.path.parent / BUNDLED_DRAFT_FILE
    bundled.parent.mkdir(parents=True)
    bundled.symlink_to(model_path)
    registry.add(LocalModel("f32", str(f32_model_path), "import",
                            f32_model_path.stat().st_size, "F32"))
    candidates = local_candidates(registry, [str(other), str(model_path)])
    assert [name for name, _ in candidates] == ["SmolLM2-135M-Instruct (bundled)", "f32",
                                                "other.gguf"]  # the same file once
    drafts = compatible_local_drafts(f32_model_path, candidates)
    assert [d.name for d in drafts] == ["SmolLM2-135M-Instruct (bundled)"]
    # Not for the bundled model itself: the F32 copy is bigger, the other vocabulary is
    # refused, and a model never drafts for itself.
    assert compatible_local_drafts(model_path, candidates) == []


def test_target_and_draft_download_as_one_job(hub: FakeHub, registry: ModelRegistry,
                                              tmp_path: Path) -> None:
    pairing = pair_repo(TARGET, 4096, MEMORY, endpoint=hub.endpoint)
    row = next(r for r in pairing.rows if r.choice.quant == "Q8_0")
    draft = row.default_draft
    assert draft is not None and draft.choice is not None
    items = job_items(row.choice, None, draft=draft.choice)
    assert [i.filename for i in items] == [TARGET_Q8, CATALOG_DRAFT_FILE]
    cache = tmp_path / "cache"
    downloader = Downloader(cache, hub.endpoint, token=False, backoff_s=0.0)
    model, result = install(row.choice, None, downloader, registry, draft=draft)
    assert result.paths[1] == Path(model.draft_path)  # type: ignore[arg-type]
    assert Path(model.draft_path).read_bytes() == \
        hub.repos[CATALOG_DRAFT].files[CATALOG_DRAFT_FILE]  # type: ignore[arg-type]
    assert (model.draft_repo, model.draft_files) == (CATALOG_DRAFT, (CATALOG_DRAFT_FILE,))
    assert model.draft_commit == hub.repos[CATALOG_DRAFT].commit
    assert registry.get(model.name).draft_path == model.draft_path
    assert model.draft_label == f"{CATALOG_DRAFT}/{CATALOG_DRAFT_FILE}"
    # A second target keeps the shared draft when the first one's files are deleted.
    q4 = next(r for r in pairing.rows if r.choice.quant == "Q4_K_M")
    other, _ = install(q4.choice, None, downloader, registry, draft=draft)
    assert Path(other.path).name == TARGET_Q4 and other.draft_path == model.draft_path
    registry.remove(model.name, delete_files=True, cache_dir=cache)
    assert Path(model.draft_path).is_file() and not Path(model.path).exists()
    registry.remove(other.name, delete_files=True, cache_dir=cache)
    assert not Path(model.draft_path).exists()


def test_models_json_without_draft_fields_still_reads(registry: ModelRegistry,
                                                      tmp_path: Path) -> None:
    row = asdict(LocalModel("old", str(tmp_path / "m.gguf"), "import", 1, "Q4_0"))
    for key in ("draft_path", "draft_repo", "draft_commit", "draft_files"):
        del row[key]
    registry.path.parent.mkdir(parents=True)
    registry.path.write_text(json.dumps([row]))
    (model,) = registry.list()
    assert model.draft_path is None and model.draft_files == () and model.draft_label == "-"
