"""Search, listing, quantization names, header facts, fit labels and draft-head
matching, against a local fake Hub through the real huggingface_hub client."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from engine.errors import HubServerError, NetworkUnavailableError
from engine.gguf.header import read_facts_prefix
from engine.hub.catalog import HeadPair, matching_heads
from engine.hub.fit import FITS_GPU, FITS_RAM, TOO_LARGE, MachineMemory, estimate_fit
from engine.hub.quant import group_shards, parse_quant
from engine.hub.search import list_repo, read_remote_facts, search_gguf
from tests.hub_server import (
    HEAD_REPO,
    TARGET_REPO,
    FakeHub,
    FakeRepo,
    standard_repos,
    write_tiny_gguf,
)

GiB = 2**30


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    with FakeHub(standard_repos(tmp_path_factory.mktemp("repos"))) as h:
        yield h


@pytest.mark.parametrize(("name", "quant"), [
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
    ("smollm2-135m-instruct-q8_0.gguf", "Q8_0"),
    ("Meta-Llama-3-8B-Instruct.IQ3_XS.gguf", "IQ3_XS"),
    ("qwen2.5-0.5b-instruct-fp16.gguf", "F16"),
    ("model-BF16.gguf", "BF16"),
    ("big-Q4_0-00001-of-00003.gguf", "Q4_0"),
    ("dir/Phi-3-mini-4k-instruct-IQ2_XXS.gguf", "IQ2_XXS"),
    ("ggml-model-q4_0_4_4.gguf", "Q4_0_4_4"),
    ("weird.gguf", "unknown"),
])
def test_parse_quant(name: str, quant: str) -> None:
    assert parse_quant(name) == quant


def test_group_shards_keeps_complete_splits_only() -> None:
    names = ["a-Q4_0-00002-of-00002.gguf", "a-Q4_0-00001-of-00002.gguf", "b.gguf",
             "c-00001-of-00003.gguf", "mmproj-f16.gguf", "README.md"]
    assert group_shards(names) == [["a-Q4_0-00001-of-00002.gguf",
                                    "a-Q4_0-00002-of-00002.gguf"], ["b.gguf"]]


def test_search_finds_gguf_repos_most_downloaded_first(hub: FakeHub) -> None:
    hits = search_gguf("llama", endpoint=hub.endpoint)
    assert [h.repo_id for h in hits] == [TARGET_REPO, "someone/Wide-Llama-GGUF",
                                         "someone/Split-Llama-GGUF"]
    assert hits[0].n_downloads == 100
    assert search_gguf("no-such-thing", endpoint=hub.endpoint) == []


def test_listing_has_quant_size_and_sha256(hub: FakeHub) -> None:
    listing = list_repo(TARGET_REPO, endpoint=hub.endpoint)
    repo = hub.repos[TARGET_REPO]
    assert listing.commit == repo.commit
    choices = listing.gguf_choices()
    assert [c.quant for c in choices] == ["Q4_K_M", "Q8_0"]  # smallest first
    q4 = choices[0]
    assert q4.n_bytes == len(repo.files["Tiny-Llama-Q4_K_M.gguf"])
    assert q4.files[0].sha256 == repo.etag("Tiny-Llama-Q4_K_M.gguf")
    readme = listing.file("README.md")
    assert readme.sha256 is None and readme.etag == repo.etag("README.md")  # git blob id


def test_split_model_is_one_choice(hub: FakeHub) -> None:
    (choice,) = list_repo("someone/Split-Llama-GGUF", endpoint=hub.endpoint).gguf_choices()
    assert choice.quant == "Q4_0" and len(choice.files) == 2
    assert choice.name.endswith("00001-of-00002.gguf")


def test_remote_header_facts_from_a_range_read(hub: FakeHub) -> None:
    choice = list_repo(TARGET_REPO, endpoint=hub.endpoint).gguf_choices()[0]
    facts = read_remote_facts(choice, endpoint=hub.endpoint)
    assert facts is not None
    assert (facts.architecture, facts.n_layers, facts.hidden_size) == ("llama", 2, 64)
    assert (facts.n_kv_heads, facts.head_dim_k, facts.vocab_size) == (2, 16, 96)
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith(choice.name)]
    assert ranges and ranges[-1] == "bytes=0-524287"  # a prefix, not the whole file


def test_header_reader_tolerates_a_cut_prefix(tmp_path: Path) -> None:
    from tests.hub_server import write_tiny_gguf

    data = write_tiny_gguf(tmp_path / "m.gguf").read_bytes()
    facts = read_facts_prefix(data[:200])  # ends inside the metadata
    assert facts.architecture == "llama" and facts.vocab_size is None
    with pytest.raises(ValueError, match="not a GGUF"):
        read_facts_prefix(b"PK\x03\x04" + bytes(100))


def test_fit_labels(tmp_path: Path) -> None:
    from tests.hub_server import write_tiny_gguf

    facts = read_facts_prefix(write_tiny_gguf(tmp_path / "m.gguf").read_bytes())
    gpu = MachineMemory(ram_total=16 * GiB, ram_available=8 * GiB, vram_free=8 * GiB)
    cpu = MachineMemory(ram_total=16 * GiB, ram_available=8 * GiB, vram_free=None)
    fit = estimate_fit(4 * GiB, 100 * 2**20, 4096, facts, gpu)
    assert fit.label == FITS_GPU and fit.kv_from_header
    # 2 layers x 2 KV heads x 4096 tokens x (16 K dims x 34/32 bytes (Q8_0) + 16 V dims
    # x 2 bytes (F16)): Tandem's cache
    assert fit.n_kv_bytes == int(2 * 2 * 4096 * (16 * 34 / 32 + 16 * 2))
    assert estimate_fit(4 * GiB, 0, 4096, facts, cpu).label == FITS_RAM
    # 7.5 GiB x 1.1 + 256 MiB of compute buffers is over 8 GiB of VRAM and 80% of RAM.
    assert estimate_fit(int(7.5 * GiB), 0, 4096, facts, gpu).label == TOO_LARGE
    # Without header numbers, the KV cache is estimated from the weights' size.
    est = estimate_fit(4 * GiB, 0, 4096, None, cpu)
    assert not est.kv_from_header and 0 < est.n_kv_bytes < GiB


def test_heads_by_fingerprint_and_catalog(hub: FakeHub) -> None:
    choice = list_repo(TARGET_REPO, endpoint=hub.endpoint).gguf_choices()[0]
    facts = read_remote_facts(choice, endpoint=hub.endpoint)
    catalog = (HeadPair("*tiny-llama*", "tandem/catalog-head"),
               HeadPair("*mistral*", "tandem/wide-head"))
    heads = matching_heads(TARGET_REPO, facts, catalog=catalog, endpoint=hub.endpoint)
    assert [(h.repo_id, h.source) for h in heads] == [("tandem/catalog-head", "catalog"),
                                                      (HEAD_REPO, "fingerprint")]
    assert heads[1].trained_for is not None and heads[1].trained_for.hidden_size == 64
    assert {f.filename for f in heads[1].files} == {"head.json", "head.safetensors"}
    assert heads[1].n_bytes == sum(len(b) for b in hub.repos[HEAD_REPO].files.values())


def test_missing_repo_is_a_clear_error(hub: FakeHub) -> None:
    with pytest.raises(HubServerError, match="404") as info:
        list_repo("nobody/nothing", endpoint=hub.endpoint)
    assert info.value.status == 404


def test_no_network_is_a_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(NetworkUnavailableError, match="cannot reach the Hub"):
        list_repo(TARGET_REPO, endpoint=f"http://127.0.0.1:{port}")


def test_base_models_are_labelled_and_listed_after_instruct_ones(tmp_path: Path) -> None:
    """A chat app wants instruct models: a repository whose name says base is marked and
    comes after the others, however often it was downloaded."""
    tiny = write_tiny_gguf(tmp_path / "t.gguf").read_bytes()
    repos = [FakeRepo("org/Cool-7B-Base-GGUF", {"c.gguf": tiny}, downloads=900),
             FakeRepo("org/Cool-7B-Instruct-GGUF", {"c.gguf": tiny}, downloads=50),
             FakeRepo("org/Cool-7B-GGUF", {"c.gguf": tiny}, downloads=10)]
    with FakeHub(repos) as hub:
        hits = search_gguf("cool", endpoint=hub.endpoint)
    assert [h.repo_id for h in hits] == ["org/Cool-7B-Instruct-GGUF", "org/Cool-7B-GGUF",
                                         "org/Cool-7B-Base-GGUF"]
    assert [h.base_model for h in hits] == [False, False, True]
