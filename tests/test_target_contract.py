"""One target contract (engine.decoding.target_contract): the engine's ``Target`` and a
parallel lane's ``LaneTarget`` each have every member ``generate`` asks for, callable as
it calls them; and the child-process proxy (engine.session_process) gives exactly the
facts its dataclasses name, a member the engine lacks being an AttributeError at once."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from engine.decoding.parallel import LaneTarget
from engine.decoding.target_contract import DecodingTarget
from engine.session_process import (
    EngineFacts,
    EngineProcess,
    TargetFacts,
    _Facts,
    _serve_call,
    _snapshot,
    _TargetProxy,
    read_facts,
)


def contract_members(protocol: type) -> dict[str, Any]:
    """A protocol's members: name -> its declaration (a function or a property)."""
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


MEMBERS = contract_members(DecodingTarget)


def test_the_contract_names_what_generate_reads():
    assert {"model", "arch", "n_ctx", "n_past", "n_used", "prefill", "verify", "commit",
            "decode_greedy", "rollback", "trees", "max_draft", "max_leaves", "n_parked",
            "compact", "greedy_in_c", "tokenize", "token_bytes",
            "is_end_of_generation", "set_features"} == set(MEMBERS)


def _check_satisfies(target: object) -> None:
    """Every member there; each method takes the contract's arguments as the contract
    passes them (positional, and ``special`` by name)."""
    for name, declared in MEMBERS.items():
        assert hasattr(target, name), f"{type(target).__name__} lacks {name}"
        if isinstance(declared, property):
            continue
        wanted = [p for p in inspect.signature(declared).parameters.values()
                  if p.name != "self"]
        positional = [None] * sum(p.kind is p.POSITIONAL_ONLY for p in wanted)
        keywords = {p.name: None for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD}
        inspect.signature(getattr(target, name)).bind(*positional, **keywords)


def test_a_lane_target_satisfies_the_contract_without_pretending():
    facts = SimpleNamespace(model=object(), arch=object(), n_ctx=512)
    lane = LaneTarget(SimpleNamespace(target=facts), 0)
    _check_satisfies(lane)
    # What it can verify are properties with their reasons, not class attributes.
    for name in ("trees", "max_draft", "max_leaves", "n_parked", "greedy_in_c"):
        member = inspect.getattr_static(LaneTarget, name)
        assert isinstance(member, property) and member.__doc__, name
    assert (lane.trees, lane.max_draft, lane.n_parked, lane.greedy_in_c) == (False, 0, 0, False)
    assert lane.model is facts.model and lane.arch is facts.arch and lane.n_ctx == 512


def test_the_engines_target_satisfies_the_contract(target):  # noqa: ANN001
    _check_satisfies(target)


# --- the child-process proxy ---------------------------------------------------------------
def _names(facts: type) -> list[str]:
    return [f.name for f in dataclasses.fields(facts)]


def _owner(facts: type, missing: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(**{n: f"<{n}>" for n in _names(facts) if n != missing})


@pytest.mark.parametrize("missing", _names(EngineFacts))
def test_an_engine_fact_the_engine_lacks_raises_at_once(missing: str):
    engine = _owner(EngineFacts, missing)
    engine.target = _owner(TargetFacts)
    with pytest.raises(AttributeError, match=f"the engine has no '{missing}'"):
        _snapshot(engine)


@pytest.mark.parametrize("missing", _names(TargetFacts))
def test_a_target_fact_the_target_lacks_raises_at_once(missing: str):
    engine = _owner(EngineFacts)
    engine.target = _owner(TargetFacts, missing)
    with pytest.raises(AttributeError, match=f"the engine's target has no '{missing}'"):
        _snapshot(engine)


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def test_a_call_whose_snapshot_lacks_a_fact_answers_the_error():
    engine = _owner(EngineFacts, "threads_text")
    engine.target = _owner(TargetFacts)
    engine.describe = lambda: "a model"
    pipe = _Pipe()
    _serve_call(pipe, None, engine, "engine", "describe", (), {}, (), False)
    (kind, packed, _trace), = pipe.sent
    assert kind == "err" and packed[1] == "AttributeError" and "threads_text" in packed[4]


def test_the_proxy_gives_every_fact_and_only_the_facts():
    engine = _owner(EngineFacts)
    engine.target = _owner(TargetFacts)
    process = EngineProcess.__new__(EngineProcess)  # no child: the facts as one sent them
    with pytest.raises(RuntimeError, match="not sent them yet"):
        process._facts = None
        _ = process.notes
    sent = _snapshot(engine)
    process._facts = _Facts(EngineFacts(**sent["engine"]), TargetFacts(**sent["target"]))
    process.target = _TargetProxy(process)
    for name in _names(EngineFacts):
        assert isinstance(inspect.getattr_static(EngineProcess, name), property), name
        assert getattr(process, name) == f"<{name}>"
    for name in _names(TargetFacts):
        assert isinstance(inspect.getattr_static(_TargetProxy, name), property), name
        assert getattr(process.target, name) == f"<{name}>"


def test_the_engine_and_its_target_have_every_fact(model_path, tmp_path):  # noqa: ANN001
    from engine.session import Engine, EngineConfig

    config = EngineConfig(model_path=model_path, drafter="none", n_ctx=512, n_threads=2,
                          cache_dir=tmp_path / "cache", memory_dir=tmp_path / "memory")
    with Engine(config) as engine:
        sent = _snapshot(engine)
        assert read_facts(TargetFacts, engine.target, "the target")["n_ctx"] == 512
    assert EngineFacts(**sent["engine"]).drafter_name == "none"
    assert TargetFacts(**sent["target"]).n_ctx == 512
