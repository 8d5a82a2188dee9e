"""The speed dashboard and engine choices, on the real engine and bundled model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from PySide6.QtGui import QTextDocument, QTextFormat  # noqa: E402

from app.gui import theme  # noqa: E402
from app.gui.dashboard import PlanInfo  # noqa: E402
from app.gui.markdown import render_markdown  # noqa: E402
from tests.gui_helpers import ANSWER_TIMEOUT_MS, open_window, send_and_wait  # noqa: E402


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    return tmp_path / "chat.sqlite3"


def test_live_steps_and_comparison_with_plain(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=48)
    steps = []
    w.worker.step.connect(steps.append)
    outcome = send_and_wait(qtbot, w, "Repeat exactly: the cat sat on the mat, the cat sat "
                                      "on the mat, the cat sat on the mat.")
    assert len(steps) == outcome.stats.n_steps > 0
    for e in steps:  # wall-clock phases in order: draft, then verify
        assert e.t_draft_start <= e.t_verify_start <= e.t_end
    assert w.dashboard._events == steps
    # What runs follows from the plan this machine's costs gave (a head only when the
    # planner chose one), and the dashboard shows the plan's layout.
    ready = w.engine_info
    assert ready.drafter == ready.plan["runs"]
    assert ready.plan["layout_text"] in w.dashboard.plan_layout.text()
    # When and how the costs were measured, and what set the plan.
    assert w.dashboard.plan_measured.text().startswith("Measured ")
    assert w.dashboard.plan_changed.text() != "–"
    # Whether the comparison drafts then follows a fixed curve, not this machine's load:
    # a budget learnt beside another process declined every memory draft (0 accepted).
    # The worker is idle between answers: the call is safe from this thread.
    w.worker.current_engine().pin_drafting()
    with qtbot.waitSignal(w.controller.comparison_finished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        w.dashboard.compare_button.click()
    comparison = blocker.args[0]
    assert comparison.identical  # greedy decoding is lossless
    # ... and it proved something: drafts were verified and kept. Every plan drafts from
    # memory (beside a head or alone), and the memory holds this question's answer from
    # the chat above, so the comparison's answer is drafted.
    assert "memory" in comparison.drafter
    assert sum(s.n_accepted for s in comparison.stats_dft.steps) > 0
    # A plan may heal after an answer (its signal crosses threads): the comparison drafts
    # with what the engine ran when it began, the plan shown before or after.
    assert comparison.drafter in (ready.drafter, w.engine_info.drafter)
    assert comparison.stats_plain.drafter == "none"
    bars = w.dashboard.comparison._bars.opts["height"]
    assert list(bars) == pytest.approx([comparison.stats_dft.tok_per_s,
                                        comparison.stats_plain.tok_per_s])
    print(f"\ncomparison: {ready.drafter} {comparison.stats_dft.tok_per_s:.1f} tok/s "
          f"(tau {comparison.stats_dft.mean_accepted:.2f}), plain "
          f"{comparison.stats_plain.tok_per_s:.1f} tok/s")
    assert "speed-up" in w.dashboard.compare_result.text()
    # The comparison is not part of the chat.
    assert len(w.store.messages(w.controller.current_id)) == 2


def test_mismatched_head_falls_back_and_says_so(qtbot, db: Path, model_path: Path,
                                                 tmp_path: Path) -> None:
    head = tmp_path / "other-head"
    head.mkdir()
    cfg = {"hidden_size": 64, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 128,
           "target": {"vocab_size": 1000, "hidden_size": 64, "tokenizer_sha256": "0" * 64}}
    (head / "head.json").write_text(json.dumps(cfg))
    (head / "head.safetensors").write_bytes(b"")
    w = open_window(qtbot, db, model_path)
    w.engine_panel.drafter_box.setCurrentIndex(w.engine_panel.drafter_box.findData("head"))
    with qtbot.waitSignal(w.engine_ready, timeout=ANSWER_TIMEOUT_MS) as blocker:
        w.engine_panel.add_head(head)
    ready = blocker.args[0]
    assert (ready.requested, ready.drafter) == ("head", "memory")
    assert "does not fit" in ready.note and "Using drafts from memory instead" in ready.note
    assert w.engine_panel.note.isVisibleTo(w) and "vocab_size" in w.engine_panel.note.text()
    assert "Using drafts from memory instead" in w.dashboard.plan_reason.text()
    send_and_wait(qtbot, w, "Hi!")  # still answers, with the fallback drafter
    assert w.store.get_setting("head") == str(head)


def test_plain_decoding_choice(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path, max_tokens=16)
    box = w.engine_panel.drafter_box
    box.setCurrentIndex(box.findData("none"))
    with qtbot.waitSignal(w.engine_ready, timeout=ANSWER_TIMEOUT_MS) as blocker:
        box.activated.emit(box.currentIndex())
    assert blocker.args[0].drafter == "none" and not blocker.args[0].note
    outcome = send_and_wait(qtbot, w, "Hi!")
    assert outcome.stats.drafter == "none"
    assert set(outcome.token_kinds) == {"target"}
    assert w.dashboard.tau.value.text() == "1 (plain)"


def test_plan_widget_takes_a_dict_or_dataclass(qtbot, db: Path, model_path: Path) -> None:
    w = open_window(qtbot, db, model_path)
    w.dashboard.set_plan({"layout": "head on GPU", "budget": "6 nodes", "reason": "fast"})
    assert w.dashboard.plan_layout.text() == "head on GPU"
    w.dashboard.set_plan(PlanInfo("CPU", "4", "slow GPU"))
    assert w.dashboard.plan_reason.text() == "slow GPU"
    w.dashboard_toggle.setChecked(True)  # a side panel the user opens: drawn when shown
    send_and_wait(qtbot, w, "Hi!")

    def titled() -> bool:
        title = w.dashboard.timeline.plotItem.titleLabel.text
        return ("no GPU" in title) != w.dashboard.gpu

    qtbot.waitUntil(titled, timeout=5000)


def test_code_blocks_are_monospace_on_a_background(qapp) -> None:  # noqa: ANN001
    doc = QTextDocument()
    render_markdown(doc, "Text\n\n```python\nprint(1)\n```\n")
    code = doc.begin().next()
    assert code.text() == "print(1)"
    assert code.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)
    assert code.blockFormat().background().color() == theme.color("code_background")
    assert code.begin().fragment().charFormat().fontFixedPitch()


def test_added_gguf_is_offered_and_loaded(qtbot, db: Path, model_path: Path,
                                          tmp_path: Path) -> None:
    user_model = tmp_path / "my-model.gguf"
    user_model.symlink_to(model_path)
    w = open_window(qtbot, db, model_path, max_tokens=8)
    with qtbot.waitSignal(w.engine_ready, timeout=ANSWER_TIMEOUT_MS) as blocker:
        w.engine_panel.add_model(user_model)  # what "Add GGUF…" and the wizard call
    assert blocker.args[0].model_path == str(user_model)
    assert w.engine_panel.model_box.currentText() == "my-model.gguf"
    assert "my-model.gguf" in w.engine_panel.state.text()
    send_and_wait(qtbot, w, "Hi!")
    # The choice is remembered for the next start.
    w.close()
    w2 = open_window(qtbot, db, model_path)
    assert w2.engine_panel.choice().model_path == user_model


@pytest.mark.slow
def test_provisional_costs_are_measured_again_when_the_app_is_idle(qtbot, db: Path,
                                                                   model_path: Path,
                                                                   monkeypatch) -> None:
    import engine.planning.plan_maker as session
    from engine.drafters import DEFAULT_EAGLE3_HEAD, DEFAULT_HEAD_DIR
    from engine.hub.model_store import data_dir
    from engine.planning.calibration import CalibrationCache, cache_key
    from engine.planning.machine_load import LoadReading
    from engine.runtime.hardware import probe_hardware
    from tests.test_plan_check import _busy

    # Costs recorded on a busy machine, and the machine looks busy at start: kept.
    monkeypatch.setattr(session, "look_at_load", lambda _t: LoadReading(2.0, 0.3, 0))
    cache = CalibrationCache(data_dir() / "cache")
    key = cache_key(probe_hardware().fingerprint(), model_path, DEFAULT_HEAD_DIR, 2,
                    ("cpu",), ("cpu",), eagle3=DEFAULT_EAGLE3_HEAD)
    saved = cache.get_entry(key)
    cache.put(key, _busy())
    try:
        w = open_window(qtbot, db, model_path)
        status = w.engine_info.plan_status
        assert status["provisional"] and status["remeasure_wanted"]
        assert "busy" in w.dashboard.plan_measured.text()
        assert "provisional" in w.dashboard.plan_measured.text()
        assert w.idle_remeasure.isActive()  # armed: it measures again once the app idles
        w.idle_remeasure.setInterval(50)
        with qtbot.waitSignal(w.worker.plan_changed, timeout=ANSWER_TIMEOUT_MS) as blocker:
            w.idle_remeasure.start()
        ready = blocker.args[0]
        qtbot.waitUntil(lambda: w.engine_info is ready)  # the window has shown it
        assert w.dashboard.plan_measured.text().startswith("Measured ")
        if not ready.plan_status["provisional"]:  # quiet here: measured again, disarmed
            assert "quiet machine" in w.dashboard.plan_measured.text()
            assert not w.idle_remeasure.isActive()
            assert ready.drafter == ready.plan["runs"]
        outcome = send_and_wait(qtbot, w, "Hi!")  # the chat goes on after it
        assert outcome.stats.n_new > 0
    finally:
        if saved is not None:
            cache.put_entry(key, saved)
