"""The differential harness (tests/differential.py) and ``drafted_equals_plain`` see what
they once let pass (issue 63): a drafter that crashed mid-answer, an error every session
raised, a bad restore after a re-measure, other finish reasons or streamed text, -0 for +0
in the logits, and a shrink that replayed on the memory earlier replays wrote. Each fault
is injected into the real engine on the bundled model: a real drafter that raises after
some drafts, a decode error raised where the engine raises it, cells overwritten."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.errors import NativeError
from tests.conftest import drafted_equals_plain, pick_per_category, plain_answers
from tests.differential import Action, Case, Sessions, shrink

QUESTION = "Describe a rainy afternoon in a small town."


class CrashesAfter:
    """A real drafter that raises from its ``n + 1``-th draft on, as a head whose GPU
    goes away mid-answer does; everything else is the drafter's own."""

    def __init__(self, drafter: Any, n: int) -> None:
        self._drafter = drafter
        self._n = n
        self.n_drafts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def draft(self, max_tokens: int, token_time_s: float) -> Any:
        self.n_drafts += 1
        if self.n_drafts > self._n:
            raise RuntimeError("CUDA error: device lost")
        return self._drafter.draft(max_tokens, token_time_s)


def spoil_cells(target: Any, at: int = 4, n: int = 2) -> None:
    """Cells ``at`` .. ``at + n`` of sequence 0 decoded from other tokens (and those after
    them over these) straight into the context, the target's books and remembered prefills
    untouched: a restore that went wrong."""
    ctx = target.sequence.settled()
    tokens = list(target.tokens)
    other = [(t + 1) % target.n_vocab for t in tokens[at:at + n]] + tokens[at + n:]
    ctx.kv_remove(0, at, -1)
    features = ctx.features_on
    ctx.set_features(False)
    try:
        step = target.batch.n_tokens_max
        for start in range(0, len(other), step):
            chunk = other[start:start + step]
            pos0 = at + start
            target.batch.fill(chunk, list(range(pos0, pos0 + len(chunk))), None,
                              [False] * (len(chunk) - 1) + [True])
            ctx.decode(target.batch)
    finally:
        ctx.set_features(features)


@pytest.fixture(scope="module")
def machine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of this machine's measurements for every test here (measured once: tens
    of seconds on a busy machine); each test's memory stays its own."""
    return tmp_path_factory.mktemp("machine-cache")


def open_sessions(model_path: Path, work: Path, machine_cache: Path, n_ctx: int = 1024
                  ) -> Sessions:
    """A plain session and a memory one in ``work``, sharing ``machine_cache``."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "cache").symlink_to(machine_cache, target_is_directory=True)
    return Sessions(model_path, ["memory"], n_ctx, work)


@pytest.fixture()
def sessions(model_path: Path, tmp_path: Path, machine_cache: Path) -> Iterator[Sessions]:
    """A plain session and a memory one, after a short first answer."""
    s = open_sessions(model_path, tmp_path / "work", machine_cache)
    try:
        assert s.run(Action("new_chat", "Name three rivers.", 6)) is None
        yield s
    finally:
        s.close()


def test_a_drafter_failing_mid_answer_is_recorded_as_a_run_time_failure(target) -> None:  # noqa: ANN001
    """The user keeps the answer (plain decoding goes on), and the figures say which
    drafter call failed: not a free-text note a check would have to parse."""
    from engine.decoding.budget import VerifyCostModel
    from engine.decoding.generation import GenerationConfig, generate
    from engine.drafters import make_drafter

    prompt = target.chat_prompt([{"role": "user", "content": "Repeat: one two three, one "
                                  "two three, one two three."}])
    target.reset()
    target.set_features(False)
    plain = generate(target, prompt, None, GenerationConfig(16))
    assert not plain.stats.drafter_failed_in
    target.reset()
    drafter = CrashesAfter(make_drafter("lookup", target=target), 2)
    out = generate(target, prompt, drafter, GenerationConfig(16),  # type: ignore[arg-type]
                   cost=VerifyCostModel(slope=0.0, learn=False))
    assert out.tokens == plain.tokens and out.finish_reason == plain.finish_reason
    assert drafter.n_drafts == 3 and out.stats.drafter_failed_in == "draft"
    assert "went on with plain decoding" in out.stats.fallback
    assert out.stats.summary()["drafter_failed_in"] == "draft"


def test_drafted_equals_plain_fails_on_a_drafter_that_crashed(target, dev_prompts) -> None:  # noqa: ANN001
    from engine.drafters import make_drafter

    rows = pick_per_category(dev_prompts, 1)[:1]
    plain = plain_answers(target, rows, 12)
    with pytest.raises(AssertionError, match="went on with plain decoding"):
        drafted_equals_plain(target, CrashesAfter(make_drafter("lookup", target=target), 1),
                             rows, plain, 12)


def test_a_drafter_crashing_after_accepted_and_rejected_drafts_parts(sessions: Sessions
                                                                     ) -> None:
    """The memory drafts its first answer to a question asked again with sampling (drafts
    kept and taken back), then its GPU goes away: the answer is plain's token for token,
    and the differential parts all the same."""
    s = sessions
    assert s.run(Action("new_chat", QUESTION, 16)) is None
    assert s.run(Action("regenerate", QUESTION, 16, seed=5)) is None
    assert s.run(Action("regenerate", QUESTION, 16, seed=11)) is None
    assert s.accepted["memory"] > 0 and s.rejected["memory"] > 0, (s.accepted, s.rejected)
    engine = s.services["memory"].engine
    engine.drafter = CrashesAfter(engine.drafter, 1)
    found = s.run(Action("regenerate", QUESTION, 16, seed=7))
    assert found is not None and found.drafter == "memory", found
    assert "failed in draft" in found.what, found


def test_a_decode_failing_in_every_session_parts(sessions: Sessions,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every session's next prompt fails to decode: that is no agreement."""
    def failing(*_args: object, **_kwargs: object) -> None:
        raise NativeError("llama_decode", 1, "no KV slot for the batch")

    for service in sessions.services.values():
        monkeypatch.setattr(service.engine.target, "prefill", failing)
    found = sessions.run(Action("follow_up", "And three lakes?", 6))
    assert found is not None and "every session raised NativeError" in found.what, found
    assert sessions.errors and "NativeError" in sessions.errors[0]


def test_a_refusal_every_session_gives_is_reported_and_the_caches_probed(
        model_path: Path, tmp_path: Path, machine_cache: Path) -> None:
    """A prompt that does not fit is plain decoding's own refusal: reported, not a
    divergence; but the cache each session keeps after it is still compared."""
    s = open_sessions(model_path, tmp_path, machine_cache, n_ctx=256)
    try:
        assert s.run(Action("new_chat", "Name three rivers.", 6)) is None
        answer = s.services["memory"].answer

        def spoiled_then_refused(*args: object, **kwargs: object) -> object:
            spoil_cells(s.services["memory"].engine.target)
            return answer(*args, **kwargs)

        s.services["memory"].answer = spoiled_then_refused  # type: ignore[method-assign]
        found = s.run(Action("follow_up", "Say it again. " * 200, 6))
        assert found is not None and "first-token logits" in found.what, found
        assert s.errors and "ContextFullError" in s.errors[0], s.errors
    finally:
        s.close()


def test_the_probe_after_a_remeasure_reads_the_restored_cells(sessions: Sessions) -> None:
    """A re-measure puts the cells back with the remembered prefills: the last probe's
    prompt again returned its remembered logits, and a bad restore went unseen."""
    engine = sessions.services["memory"].engine

    def bad_restore(*_args: object) -> bool:
        spoil_cells(engine.target)
        return False

    engine.remeasure = bad_restore
    found = sessions.run(Action("remeasure"))
    assert found is not None and "first-token logits" in found.what, found


def test_a_remeasure_that_restores_well_parts_nowhere(sessions: Sessions) -> None:
    """The other question after a re-measure is asked alike in every session."""
    for _ in range(2):  # twice: the question alternates
        assert sessions.run(Action("remeasure")) is None
    assert sessions.run(Action("follow_up", "And three lakes?", 6)) is None


@pytest.mark.parametrize("fault", ["finish_reason", "streamed"])
def test_another_finish_reason_or_streamed_text_parts(sessions: Sessions, fault: str) -> None:
    service = sessions.services["memory"]
    answer = service.answer

    def faulty(question: Any, **kwargs: Any) -> Any:
        if fault == "streamed":  # the tokens right, the text a client saw wrong
            on_text = kwargs["on_text"]
            kwargs["on_text"] = lambda piece: on_text(piece.upper())
        got = answer(question, **kwargs)
        if fault == "finish_reason":
            got = replace(got, result=replace(got.result, finish_reason="stop"))
        return got

    service.answer = faulty  # type: ignore[method-assign]
    found = sessions.run(Action("follow_up", "And three lakes?", 6))
    assert found is not None and found.drafter == "memory", found
    assert ("finished for 'stop'" if fault == "finish_reason" else "streamed") in found.what


def test_minus_zero_is_not_plus_zero_in_the_probe(sessions: Sessions,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name, service in sessions.services.items():
        target = service.engine.target
        real = target.prefill

        def signed(prompt: list[int], tail: int | None = None, real: Any = real,
                   zero: float = 0.0 if name == "none" else -0.0) -> Any:
            pre = real(prompt, tail)
            pre.logits = np.array(pre.logits, copy=True)
            pre.logits[0] = zero
            return pre

        monkeypatch.setattr(target, "prefill", signed)
    found = sessions.run(Action("switch_branch"))  # a probe alone
    assert found is not None and "other bits" in found.what, found


def test_every_replay_of_a_shrink_starts_from_an_empty_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``--replay`` does: a replay in the run's folder drafted from the memory the run
    and the replays before it wrote, so a shrunk case might not part again."""
    import tests.differential as differential

    work = tmp_path / "run"
    (work / "mem-memory").mkdir(parents=True)
    (work / "mem-memory" / "memory.bin").write_bytes(b"the run's memory")
    found_there: list[list[str]] = []

    def play(case: Case, folder: Path) -> differential.Replay:
        found_there.append(sorted(p.name for p in folder.rglob("*")))
        (folder / "mem-memory").mkdir(parents=True, exist_ok=True)
        (folder / "mem-memory" / "memory.bin").write_bytes(b"this replay's memory")
        found = object() if "b" in {a.text for a in case.actions} else None
        return differential.Replay(found, 0, {}, {})  # type: ignore[arg-type]

    monkeypatch.setattr(differential, "play", play)
    actions = [Action("new_chat", "a"), Action("follow_up", "b"), Action("follow_up", "c")]
    shrunk = shrink(Case(1, "m.gguf", ["memory"], 1024, actions), work)
    assert [a.text for a in shrunk.actions] == ["a", "b"]
    assert len(found_there) > 1 and all(not seen for seen in found_there), found_there
