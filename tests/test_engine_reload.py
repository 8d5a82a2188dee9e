"""A reload that fails brings the previous engine back and says why; the context a
reload may raise to for documents counts the whole engine (the drafter and its cache,
the F16 context prompts are read in), on the real bundled model."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from app.gui.context_room import largest_context  # noqa: E402
from app.gui.engine_worker import EngineChoice, EngineWorker, _max_ctx  # noqa: E402
from engine.planning.memory_plan import engine_memory, planned_memory  # noqa: E402
from engine.runtime.memory_fit import RAM_HEADROOM  # noqa: E402


@pytest.fixture()
def worker(qapp, model_path: Path):  # noqa: ANN001
    w = EngineWorker()
    w.events: list[tuple[str, object]] = []
    w.ready.connect(lambda r: w.events.append(("ready", r)))
    w.failed.connect(lambda f: w.events.append(("failed", f)))
    yield w
    w.shutdown()


def test_a_reload_that_fails_brings_the_previous_engine_back(worker, model_path: Path,
                                                             tmp_path: Path) -> None:
    worker.load(EngineChoice(model_path, "none", n_ctx=2048, n_threads=2))
    assert [kind for kind, _ in worker.events] == ["ready"]
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))
    worker.load(EngineChoice(broken, "none", n_ctx=4096, n_threads=2))
    kind, ready = worker.events[-1]
    assert kind == "ready" and ready.n_ctx == 2048 and ready.model_path == str(model_path)
    assert ready.note.startswith("Could not load the new setting (")
    assert "the previous engine is back" in ready.note
    assert worker.current_engine() is not None
    # With nothing to go back to, the failure is said as it is.
    fresh = EngineWorker()
    failures = []
    fresh.failed.connect(failures.append)
    fresh.load(EngineChoice(broken, "none", n_ctx=2048, n_threads=2))
    assert failures and failures[0].kind == "load" and fresh.current_engine() is None


def test_the_raised_context_counts_the_draft_model(worker, model_path: Path) -> None:
    worker.load(EngineChoice(model_path, "draft", n_ctx=2048, n_threads=2,
                             draft_model=model_path))
    kind, ready = worker.events[-1]
    assert kind == "ready", ready
    engine = worker.current_engine()
    target = engine.target
    whole = engine_memory(engine.model, target, engine.setup.spec, engine.config.draft_model,
                          8192).total
    alone = planned_memory(engine.model, 8192, target.config.type_k, target.config.type_v,
                           n_batch=target.config.n_batch).total
    assert whole > alone  # the draft model and its cache
    # Room for the target's 8k alone, not for the whole engine at 8k.
    engine.hardware = replace(engine.hardware,
                              ram_available_bytes=int((whole + alone) / 2 / RAM_HEADROOM))
    grown = _max_ctx(engine)
    assert 2048 <= grown < 8192
    fits = engine_memory(engine.model, target, engine.setup.spec,
                         engine.config.draft_model, grown).total
    assert fits <= engine.hardware.ram_available_bytes * RAM_HEADROOM
    # The rule alone, without the drafter, would have offered the trained 8k.
    assert largest_context(
        lambda n: planned_memory(engine.model, n, target.config.type_k,
                                 target.config.type_v, n_batch=target.config.n_batch),
        engine.model, engine.hardware, 2048, 0, False) == 8192
