"""Workers (issue 37): `tandem worker` serves this machine's devices through llama.cpp's RPC
backend and `--workers` puts the target's layers there. Workers here are real second
processes on 127.0.0.1. Greedy output through a worker equals plain decoding with every
drafter (and equals this machine's own decoding with the same kernels); a worker that is
unreachable, of another protocol version or silent is refused from Python before
llama.cpp connects (it would abort the process); a worker killed mid-answer ends that
answer with a clear error while the app lives on and reopens the model locally; a bind
beyond loopback needs the explicit flag."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from app.benchmarks.loopback_worker import free_port, loopback_worker
from engine.conversation import LOCAL_AGAIN, AnswerService, Question
from engine.decoding.budget import VerifyCostModel
from engine.decoding.generation import GenerationConfig, generate
from engine.decoding.sampling import SamplingParams
from engine.drafters import DrafterSpec, build_drafter
from engine.drafters.suffix_index import SuffixIndex
from engine.errors import (
    DrafterUnavailableError,
    InvalidSettingError,
    WorkerError,
    WorkerLostError,
)
from engine.gguf.architectures import TinyShape, write_architecture_gguf
from engine.runtime.target import Target, TargetConfig
from engine.session import Engine, EngineConfig
from engine.session_process import EngineProcess
from engine.workers.endpoints import check_bind, is_loopback, parse_workers
from engine.workers.handshake import PROTOCOL, probe_worker
from tests.conftest import REPO
from tests.test_eagle3_drafter import copying_head

MAX_TOKENS = 24
CHAT = "List the numbers from 1 to 12, one per line."
REPEATING = "0 0 0 0 0 0 0 0 0 0 0 0 0 0"


def running_worker(*extra: str):  # noqa: ANN201
    """`tandem worker` in a second process (2 threads, its output readable), until the
    block ends."""
    return loopback_worker(2, *extra, capture=True)


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    with running_worker() as (endpoint, _):
        yield endpoint


@pytest.fixture(scope="module")
def worker_target(model_path: Path, worker: str) -> Iterator[Target]:
    with Target(model_path, TargetConfig(n_ctx=1024, n_threads=2, workers=(worker,))) as t:
        yield t


def _prompts(target: Target) -> list[list[int]]:
    return [target.chat_prompt([{"role": "user", "content": CHAT}]), target.tokenize(REPEATING)]


def _run(target: Target, prompt: list[int], drafter) -> object:  # noqa: ANN001
    target.reset()
    target.set_features(False)
    return generate(target, prompt, drafter, GenerationConfig(MAX_TOKENS),
                    cost=VerifyCostModel(slope=0.0, learn=False))


# --- the handshake and the bind policy -------------------------------------------------------
def test_handshake_reads_the_library_servers_version_and_memory(worker: str):
    info = probe_worker(worker)
    # PROTOCOL is written down from ggml-rpc.h: the library's own server must agree.
    assert info.version == PROTOCOL
    assert info.devices and info.free_bytes > 0
    assert 0 < info.round_trip_s < 1.0
    assert worker in info.describe() and "protocol 7." in info.describe()


def _fake_worker(reply: bytes | None) -> tuple[str, socket.socket]:
    """A listener that answers HELLO with ``reply`` (None: accepts and says nothing)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.recv(1 + 8 + 24)
                if reply is not None:
                    conn.sendall(struct.pack("<Q", len(reply)) + reply)
                time.sleep(2)

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}", server


def test_a_worker_of_another_version_is_refused_before_llama_cpp_connects(model_path: Path):
    endpoint, server = _fake_worker(bytes([6, 1, 0, 0]) + bytes(24))
    # In this process: llama.cpp would abort it on this handshake.
    with server, pytest.raises(WorkerError, match=r"protocol 6\.1\.0 and this Tandem 7\."):
        Engine(EngineConfig(model_path=model_path, drafter="none", workers=(endpoint,)))


def test_silent_closed_and_absent_workers_are_refused_with_the_reason():
    endpoint, server = _fake_worker(None)
    with server, pytest.raises(WorkerError, match="did not answer"):
        probe_worker(endpoint, timeout_s=0.3)
    endpoint, server = _fake_worker(b"")
    with server, pytest.raises(WorkerError, match="where 28 were due"):
        probe_worker(endpoint)
    with pytest.raises(WorkerError, match="cannot connect"):
        probe_worker(f"127.0.0.1:{free_port()}")


def test_endpoints_parse_and_the_bind_policy_keeps_workers_on_loopback():
    assert parse_workers("127.0.0.1:50052, localhost:7") == ("127.0.0.1:50052", "localhost:7")
    assert parse_workers("[::1]:9") == ("::1:9",)
    for bad in ("127.0.0.1", "host:port", "h:0", "a:1,a:1"):
        with pytest.raises(InvalidSettingError):
            parse_workers(bad)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20")
    check_bind("127.0.0.1", allow_network=False)
    check_bind("0.0.0.0", allow_network=True)
    with pytest.raises(InvalidSettingError, match="no authentication"):
        check_bind("0.0.0.0", allow_network=False)


def test_the_worker_command_refuses_a_network_bind_without_the_flag_and_warns_with_it():
    refused = subprocess.run([sys.executable, "-m", "app.cli", "worker", "--host", "0.0.0.0"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--allow-network" in refused.stderr
    with running_worker("--host", "0.0.0.0", "--allow-network") as (endpoint, process):
        probe_worker(endpoint)
        process.kill()
        said = process.communicate(timeout=10)[0]
    assert "WARNING" in said and "no authentication" in said and "ssh -N -L" in said


# --- lossless through a worker ----------------------------------------------------------------
def test_a_worker_decodes_as_this_machine_does_with_the_same_kernels(model_path: Path,
                                                                      worker_target: Target):
    # A worker's weights are never repacked: this machine without repacking is its twin.
    with Target(model_path, TargetConfig(n_ctx=1024, n_threads=2, repack=False)) as local:
        for prompt in _prompts(worker_target):
            assert _run(worker_target, prompt, None).tokens == _run(local, prompt, None).tokens
    assert worker_target.f16_prefill_off and "workers" in worker_target.f16_prefill_off


@pytest.mark.parametrize("name", ["lookup", "memory", "head", "head+memory", "draft", "eagle3"])
def test_every_drafter_is_lossless_through_a_worker(name: str, worker_target: Target,
                                                   model_path: Path, tmp_path: Path):
    target = worker_target
    spec = DrafterSpec(name)
    if name == "draft":  # the bundled model drafting for itself, on this machine
        spec = DrafterSpec(name, draft_model=model_path)
    elif name == "eagle3":
        spec = DrafterSpec(name, head_dir=copying_head(tmp_path / "head.gguf", model_path))
        # The head shares the target's embeddings and LM head: with the output on the
        # worker it is refused (llama.cpp would abort), with the output here it drafts.
        with pytest.raises(DrafterUnavailableError, match="run on the workers"):
            build_drafter(spec, target)
        target = Target(model_path, replace(target.config, output_here=True))
    drafter = build_drafter(spec, target, memory=SuffixIndex())
    try:
        accepted = 0
        for prompt in _prompts(target):
            plain = _run(target, prompt, None).tokens
            for _ in range(2):  # the second time, memory drafts know the answer
                out = _run(target, prompt, drafter)
                assert out.tokens == plain, name
                assert not out.stats.fallback
                accepted += sum(s.n_accepted for s in out.stats.steps)
        assert accepted > 0, f"{name}: no draft accepted, nothing was checked"
    finally:
        if drafter is not None:
            drafter.close()
        if target is not worker_target:
            target.close()


def test_mtp_is_lossless_through_a_worker_with_recurrent_state(model_path: Path, worker: str,
                                                               tmp_path: Path):
    """A hybrid (gated delta nets) whose layers, state snapshots and MTP block are all on
    the worker."""
    from engine.drafters.mtp import MtpDrafter

    path = write_architecture_gguf("qwen35", tmp_path / "qwen35-mtp.gguf", model_path,
                                   TinyShape(mtp_layers=1, damp=0.22))
    with Target(path, TargetConfig(n_ctx=512, n_threads=2, workers=(worker,))) as target:
        assert target.arch.rs_rollback and target.model.mtp_loaded
        drafter = MtpDrafter(target)
        try:
            accepted = 0
            for text in ("The quick brown fox jumps over the lazy dog. The quick brown",
                         "Once upon a time, in a small village by the sea, there lived"):
                prompt = target.tokenize(text)
                plain = _run(target, prompt, None).tokens
                out = _run(target, prompt, drafter)
                assert out.tokens == plain, text
                accepted += sum(s.n_accepted for s in out.stats.steps)
            assert accepted > 0
        finally:
            drafter.close()


# --- the engine in a child process ------------------------------------------------------------
@pytest.fixture()
def engine_config(model_path: Path, tmp_path: Path) -> EngineConfig:
    return EngineConfig(model_path=model_path, drafter="lookup", n_ctx=1024, n_threads=2,
                        cache_dir=tmp_path / "cache", memory_dir=tmp_path / "memory")


def test_an_engine_through_a_worker_runs_in_a_child_and_answers_as_plain_decoding(
        engine_config: EngineConfig):
    with running_worker() as (endpoint, _), \
            EngineProcess(replace(engine_config, drafter="memory",
                                  workers=(endpoint,))) as engine:
        assert engine.alive and engine.drafter_name == "memory"
        assert any(endpoint in note for note in engine.notes)
        assert endpoint in engine.describe()
        engine.pin_drafting()  # what is drafted must not follow the worker's timings
        prompt = engine.chat_prompt([{"role": "user", "content": CHAT}])
        texts: list[str] = []
        drafted = engine.generate(prompt, GenerationConfig(MAX_TOKENS), on_text=texts.append)
        plain = engine.generate(prompt, GenerationConfig(MAX_TOKENS), plain=True)
        assert drafted.tokens == plain.tokens and "".join(texts) == drafted.text
        # Asked again with sampling: memory drafts the first answer, the sampled ones part
        # from it (drafts kept and taken back), and each equals plain decoding's.
        steps = list(drafted.stats.steps)
        for seed in (5, 11):
            sampled = GenerationConfig(MAX_TOKENS, sampling=SamplingParams(0.8, seed=seed))
            again = engine.generate(prompt, sampled)
            assert again.tokens == engine.generate(prompt, sampled, plain=True).tokens
            steps += again.stats.steps
        assert sum(s.n_accepted for s in steps) > 0
        assert sum(s.n_proposed - s.n_accepted for s in steps) > 0
        assert engine.target.n_ctx == 1024 and engine.target.tokenize("hi", special=False)
        assert engine.target.token_bytes(drafted.tokens[0])
        # Stopping crosses the process boundary as the GUI's stop button does.
        seen: list[str] = []
        story = engine.chat_prompt([{"role": "user", "content": "Tell me a long story."}])
        stopped = engine.generate(story, GenerationConfig(200), on_text=seen.append,
                                  should_stop=lambda: len(seen) >= 3)
        assert stopped.finish_reason == "cancelled" and len(stopped.tokens) < 200

        def interrupt(_text: str) -> None:  # Ctrl-C while the answer streams
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            engine.generate(story, GenerationConfig(200), on_text=interrupt)
        # The child stopped that answer and the next call gets its own reply.
        assert engine.generate(prompt, GenerationConfig(MAX_TOKENS), plain=True).tokens \
            == plain.tokens


@pytest.mark.slow
def test_a_worker_killed_mid_answer_ends_the_answer_and_the_model_reopens_here(
        engine_config: EngineConfig):
    with running_worker() as (endpoint, worker_process):
        config = replace(engine_config, workers=(endpoint,))
        engine = EngineProcess(config)
        notes: list[str] = []
        service = AnswerService(engine, config, on_note=notes.append)
        try:
            prompt = engine.chat_prompt([{"role": "user", "content": "Tell me a long story."}])
            seen: list[str] = []

            def on_text(text: str) -> None:
                seen.append(text)
                if len(seen) == 5:
                    worker_process.kill()

            with pytest.raises(WorkerLostError, match=endpoint) as lost:
                engine.generate(prompt, GenerationConfig(200), on_text=on_text)
            assert "Remote RPC server crashed" in str(lost.value)  # llama.cpp's own words
            assert len(seen) >= 5 and not engine.alive
            with pytest.raises(WorkerLostError):  # and it stays said, without hanging
                engine.generate(prompt, GenerationConfig(4))
            # The one answer path opens the model here, says so, and answers.
            assert service.recover() and notes == [LOCAL_AGAIN]
            local = service.engine
            assert local is not None and not local.workers and local is not engine
            assert service.answer(Question.chat([{"role": "user", "content": CHAT}],
                                                GenerationConfig(4))).result.tokens
        finally:
            service.close()
            engine.close()
