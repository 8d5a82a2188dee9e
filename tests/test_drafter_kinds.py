"""The drafter registry (engine.drafters.kinds): one vocabulary for the CLI, settings,
plans and the engine; the names users and files hold read back as kinds; and the pieces
that left ``Engine`` (the first setup, the record and governor that follow a drafter,
the memory file) behave as they did inside it."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.decoding.budget import MAX_DRAFT, MAX_MEMORY_DRAFT
from engine.drafters import DrafterSpec
from engine.drafters.base import Drafter
from engine.drafters.kinds import (
    CHOICES,
    DRAFTER_LABELS,
    DRAFTER_NAMES,
    HEAD_DRAFTERS,
    OFFERED_DRAFTERS,
    DrafterKind,
    Need,
    is_plain,
)
from engine.errors import InvalidSettingError
from engine.planning.drafter_follow import governor_for, record_key
from engine.planning.first_setup import asked_setup
from engine.planning.planner import Budget, Overrides, Plan

NAMES = ("none", "memory", "lookup", "head", "head-chain", "head-multi", "head-ahead",
         "head+memory", "draft", "eagle3", "mtp")


def test_every_name_users_and_files_hold_reads_back_as_its_kind() -> None:
    """The CLI's, the settings' and the plans' names are the kinds' values, unchanged."""
    assert DRAFTER_NAMES == NAMES and ("auto", *NAMES) == CHOICES
    assert HEAD_DRAFTERS == ("head", "head-chain", "head-multi", "head-ahead", "head+memory")
    for name in CHOICES:
        kind = DrafterKind.parse(name)
        assert kind.value == name and str(kind) == name and f"{kind}" == name
        assert DrafterKind.parse(kind) is kind and json.dumps(kind) == json.dumps(name)
    assert OFFERED_DRAFTERS == ("auto", "head", "draft", "eagle3", "mtp", "memory", "lookup",
                                "none")
    assert DRAFTER_LABELS["memory"] == "Drafts from memory"
    with pytest.raises(ValueError, match="unknown drafter 'magic'; choose from auto, none"):
        DrafterKind.parse("magic")
    assert DrafterKind.of("magic") is None and DrafterKind.of(None) is None
    assert is_plain("none") and not is_plain("head+memory") and not is_plain("a test's")


def test_traits_say_what_each_kind_needs_and_is() -> None:
    k = DrafterKind
    assert {x for x in k if x.native} == {k.DRAFT, k.EAGLE3, k.MTP}
    assert {x for x in k if x.planned} == {k.NONE, k.MEMORY, k.HEAD, k.DRAFT, k.EAGLE3, k.MTP}
    assert {x for x in k if x.costly and x.planned} == {k.HEAD, k.DRAFT, k.EAGLE3, k.MTP}
    assert {x for x in k if x.uses_memory} == {k.MEMORY, k.HEAD_MEMORY}
    assert {x for x in k if not x.opens_memory} == {k.AUTO, k.NONE, k.LOOKUP}
    assert Need.DRAFT_GGUF in k.DRAFT.needs and Need.MTP_BLOCK in k.MTP.needs
    assert Need.TARGET_LM_HEAD in k.EAGLE3.needs and Need.HEAD_DIR in k.HEAD_AHEAD.needs
    assert not k.NONE.drafts and k.AUTO.drafts
    # A head variant's options: its defaults yield to the asked ones, its own mode wins.
    assert k.HEAD_AHEAD.head_options({"depth": 3}) == {"mode": "chain", "draft_ahead": True,
                                                       "depth": 3}
    assert k.HEAD_AHEAD.head_options({"mode": "tree"})["mode"] == "tree"
    assert k.HEAD_MULTI.head_options({"mode": "tree"}) == {"mode": "multi"}
    assert k.HEAD.head_options({"top_k": 2}) == {"top_k": 2}


def test_specs_plans_and_overrides_hold_kinds() -> None:
    """Old names still build specs and plans; a plan serialises its kinds as names."""
    spec = DrafterSpec("head-chain")
    assert spec.kind is DrafterKind.HEAD_CHAIN
    with pytest.raises(ValueError, match="'auto'"):
        DrafterSpec("auto")
    plan = Plan(layout="cpu", drafter="head", head_device="cpu", target_gpu_layers=0,
                budget=Budget(), plain_tok_per_s=10.0, predicted_tok_per_s=12.0, reason="",
                hardware="")
    assert plan.drafter is DrafterKind.HEAD and plan.runs is DrafterKind.HEAD_MEMORY
    data = json.loads(json.dumps(plan.to_json()))
    assert (data["drafter"], data["runs"]) == ("head", "head+memory")
    assert data["layout_text"] == "cpu: target on the CPU, draft head on cpu"
    assert Overrides(drafter="mtp").drafter is DrafterKind.MTP
    with pytest.raises(InvalidSettingError, match="drafter"):
        Overrides(drafter="lookup")  # the planner never chooses it


class _Fake(Drafter):
    def begin(self, context, features):  # noqa: ANN001, ANN201
        pass

    def draft(self, max_tokens, token_time_s):  # noqa: ANN001, ANN201
        raise AssertionError

    def accept(self, new_tokens, features):  # noqa: ANN001, ANN201
        pass


def test_the_record_and_governor_follow_the_drafters_kind(tmp_path: Path) -> None:
    model, head = tmp_path / "target.gguf", tmp_path / "head.gguf"
    model.write_bytes(b"1234")
    head.write_bytes(b"12")
    fake = _Fake()
    assert record_key(model, None) is None and record_key(model, fake) is None
    fake.kind = DrafterKind.MTP
    assert record_key(model, fake) == "target.gguf:4|mtp"
    fake.kind, fake.path = DrafterKind.EAGLE3, head
    assert record_key(model, fake) == "target.gguf:4|head.gguf:2"
    fake.kind = DrafterKind.MEMORY  # a fallback's steps correct no record
    assert record_key(model, fake) is None
    assert governor_for(fake).tolerance == 0.05
    fake.is_draft_model = True
    assert governor_for(fake).tolerance != 0.05
    fake.pin()  # a drafter whose drafts follow no timings has nothing to pin


@pytest.mark.parametrize(("kind", "cap"), [(DrafterKind.MEMORY, MAX_MEMORY_DRAFT),
                                           (DrafterKind.HEAD_MEMORY, MAX_MEMORY_DRAFT),
                                           (DrafterKind.HEAD, MAX_DRAFT),
                                           (DrafterKind.NONE, MAX_DRAFT)])
def test_a_drafter_asked_by_name_gets_its_default_budget(kind: DrafterKind, cap: int) -> None:
    asked = SimpleNamespace(drafter=kind, head_dir=None, head_device="cpu", draft_model=None,
                            overrides=Overrides(depth=3), recalibrate=False)
    setup = asked_setup(asked, model=None)  # type: ignore[arg-type]
    assert (setup.spec.kind, setup.max_draft, setup.gpu_layers) == (kind, cap, 0)
    assert setup.spec.head_options == {"depth": 3}
    asked.overrides = Overrides(max_draft=2)
    assert asked_setup(asked, model=None).max_draft == 2  # type: ignore[arg-type]


def test_engine_stays_small_and_speaks_kinds() -> None:
    """Building and choosing drafters live in the drafters and planning rooms; the
    engine does not branch on drafter classes or names."""
    source = (Path(__file__).parents[1] / "engine" / "session.py").read_text()
    engine = next(n for n in ast.parse(source).body
                  if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.end_lineno - engine.lineno + 1 < 400
    body = ast.get_source_segment(source, engine) or ""
    for name in NAMES:
        assert f'"{name}"' not in body
    assert "getattr(" not in body and "isinstance(" not in body
