"""The speed dashboard: live speed, acceptance, tokens by origin, CPU/GPU timeline,
the draft plan, and a one-click comparison with plain decoding."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.gui import theme
from app.gui.dashboard_plots import AcceptancePlot, ComparisonPlot, TimelinePlot
from app.gui.engine_worker import Comparison, EngineReady, GenerationOutcome, StepEvent
from app.gui.loop_monitor import LoopLag
from app.gui.plan_words import plan_in_words
from app.gui.resource_sampler import ResourceSampler
from app.gui.token_view import TokenView
from engine.decoding.budget import MAX_DRAFT_LIMIT
from engine.decoding.stats import GenerationStats
from engine.drafters.kinds import DrafterKind, is_plain


@dataclass(frozen=True)
class PlanInfo:
    """What the planner decided: where things run, the draft budget, and why."""

    layout: str
    budget: str
    reason: str
    measured: str = "–"  # when and how the costs were measured
    changed: str = "–"  # the plan's last change and why


class _Metric(QFrame):
    def __init__(self, title: str) -> None:
        super().__init__()
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.value = QLabel("–")
        self.value.setStyleSheet("font-size: 14pt; font-weight: bold;")
        caption = QLabel(title)
        caption.setWordWrap(True)
        caption.setStyleSheet(f"color: {theme.current().muted};")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 4)
        layout.addWidget(self.value)
        layout.addWidget(caption)


class DashboardWidget(QScrollArea):
    """Fed by the worker's signals (through the main window); never calls the engine."""

    compare_requested = Signal()

    def __init__(self, sampler: ResourceSampler, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.sampler = sampler
        self.gpu = False
        self._drafter: str = DrafterKind.NONE  # the engine's drafter, for the live figures
        self._t_start = 0.0
        self._events: list[StepEvent] = []
        self._dirty = False
        self._live = False

        self.tok_s = _Metric("tokens / s (decode)")
        self.ttft = _Metric("time to first token")
        self.tau = _Metric("tokens per verification")
        self.accept = _Metric("draft tokens accepted")
        self.lag = _Metric("UI delay while generating (max / p95)")
        # Two tiles a row: the panel is a side panel, and a caption wraps, never cut.
        metrics = QGridLayout()
        for i, m in enumerate((self.tok_s, self.ttft, self.tau, self.accept, self.lag)):
            metrics.addWidget(m, i // 2, i % 2)

        plan_box = QGroupBox("Plan")
        # The plan in a sentence; the planner's and the kernels' details one click away.
        self.plan_summary = QLabel("Loading the model…")
        self.plan_summary.setWordWrap(True)
        self.details_button = QPushButton("Details")
        self.details_button.setCheckable(True)
        self.plan_details = QWidget()
        self.plan_layout, self.plan_budget, self.plan_reason = QLabel(), QLabel(), QLabel()
        self.plan_measured, self.plan_changed = QLabel(), QLabel()
        for label in (self.plan_layout, self.plan_budget, self.plan_reason,
                      self.plan_measured, self.plan_changed):
            label.setWordWrap(True)
        plan_grid = QGridLayout(self.plan_details)
        plan_grid.setContentsMargins(0, 0, 0, 0)
        for row, (name, label) in enumerate((("Layout", self.plan_layout),
                                             ("Budget", self.plan_budget),
                                             ("Why", self.plan_reason),
                                             ("Measured", self.plan_measured),
                                             ("Changed", self.plan_changed))):
            plan_grid.addWidget(QLabel(f"<b>{name}</b>"), row, 0,
                                Qt.AlignmentFlag.AlignTop)
            plan_grid.addWidget(label, row, 1)
        plan_grid.setColumnStretch(1, 1)
        self.plan_details.hide()
        self.details_button.toggled.connect(self.plan_details.setVisible)
        plan_top = QHBoxLayout()
        plan_top.addWidget(self.plan_summary, 1)
        plan_top.addWidget(self.details_button, 0, Qt.AlignmentFlag.AlignTop)
        plan_layout = QVBoxLayout(plan_box)
        plan_layout.addLayout(plan_top)
        plan_layout.addWidget(self.plan_details)

        self.acceptance = AcceptancePlot()
        self.timeline = TimelinePlot()
        self.tokens = TokenView()
        self.comparison = ComparisonPlot()
        self.compare_button = QPushButton("Compare with plain decoding")
        self.compare_button.setToolTip("Runs the last prompt again with the drafter and "
                                       "without it (not saved in the chat).")
        self.compare_button.clicked.connect(self.compare_requested)
        self.compare_result = QLabel("Runs the last prompt with and without the drafter.")
        self.compare_result.setWordWrap(True)
        compare_box = QGroupBox("Comparison")
        compare_layout = QVBoxLayout(compare_box)
        compare_layout.addWidget(self.compare_button, 0, Qt.AlignmentFlag.AlignLeft)
        compare_layout.addWidget(self.compare_result)
        compare_layout.addWidget(self.comparison)

        tokens_box = QGroupBox("Last answer by token origin")
        QVBoxLayout(tokens_box).addWidget(self.tokens)
        self.tokens.setMinimumHeight(180)

        # One column: the dock is narrow, and every chart stays readable at its width.
        body = QWidget()
        layout = QVBoxLayout(body)
        layout.addLayout(metrics)
        layout.addWidget(plan_box)
        layout.addWidget(self.timeline)
        layout.addWidget(self.acceptance)
        layout.addWidget(compare_box)
        layout.addWidget(tokens_box)
        self.setWidget(body)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setMinimumWidth(340)

        self._refresh = QTimer(self)
        self._refresh.setInterval(250)  # redraws are coalesced: at most 4 per second
        self._refresh.timeout.connect(self._redraw)
        self._refresh.start()
        self.set_plan(PlanInfo("CPU", "–", "Loading the model…"))
        self.acceptance.set_counts([])
        self.comparison.set_values([])

    # --- inputs ----------------------------------------------------------------------
    def set_plan(self, info: PlanInfo | Mapping[str, str]) -> None:
        """Show the planner's decision: ``{"layout", "budget", "reason"}``."""
        if isinstance(info, Mapping):
            info = PlanInfo(str(info.get("layout", "")), str(info.get("budget", "")),
                            str(info.get("reason", "")), str(info.get("measured", "–")),
                            str(info.get("changed", "–")))
        self.plan_layout.setText(info.layout)
        self.plan_budget.setText(info.budget)
        self.plan_reason.setText(info.reason)
        self.plan_measured.setText(info.measured)
        self.plan_changed.setText(info.changed)

    def on_engine_ready(self, ready: EngineReady) -> None:
        self.plan_summary.setText(plan_in_words(ready))
        self._drafter = ready.drafter
        self.gpu = ready.gpu is not None
        self.sampler.set_gpu_available(self.gpu)
        device = f"GPU {ready.gpu} available (unused)" if ready.gpu else "no GPU"
        drafting = not is_plain(ready.drafter)
        budget = (f"up to {ready.max_draft} draft tokens per verification"
                  if drafting else "no drafting (plain decoding)")
        if ready.plan is not None:
            plan = ready.plan
            speed = (f" Expected {plan['predicted_tok_per_s']:.0f} tok/s vs "
                     f"{plan['plain_tok_per_s']:.0f} plain.")
            budget = _budget_text(plan["budget"]) if drafting else budget
            why = plan["reason"][:1].upper() + plan["reason"][1:] + speed
            status = ready.plan_status or {}
            threads = ready.threads or f"{ready.n_threads} CPU threads"
            self.set_plan(PlanInfo(f"{plan['layout_text']}; {threads}; {device}", budget,
                                   f"{why} {ready.note} {_sentence(ready.kv_cache)} "
                                   f"{_memory(ready)}{_guarantee(ready.guarantee)}".strip(),
                                   _sentence(str(status.get("costs") or "")) or "–",
                                   _sentence(str(status.get("last_change") or "")) or "–"))
            return
        reason = (ready.note or f"Drafter “{ready.drafter}” as chosen ({ready.requested}).") \
            + " " + _sentence(ready.kv_cache) + " " + _memory(ready) \
            + _guarantee(ready.guarantee)
        self.set_plan(PlanInfo(f"target and {ready.drafter} drafter on the CPU "
                               f"({ready.n_threads} threads); {device}", budget, reason))

    def on_started(self, request_id: int, kind: str) -> None:
        if kind != "answer":
            self.compare_button.setEnabled(False)
            self.compare_result.setText("Comparing… (drafter first, then plain decoding)")
            return
        self._t_start = time.perf_counter()
        self._events = []
        self._live = True
        self._dirty = True
        self.compare_button.setEnabled(False)
        for m in (self.tok_s, self.ttft, self.tau, self.accept):
            m.value.setText("…")

    def on_step(self, event: StepEvent) -> None:
        if self._live:
            self._events.append(event)
            self._dirty = True

    def on_finished(self, outcome: GenerationOutcome, lag: LoopLag) -> None:
        self._live = False
        self.compare_button.setEnabled(True)
        self._show_stats(outcome.stats)
        self.set_loop_lag(lag)
        self.tokens.set_tokens(outcome.token_texts, outcome.token_kinds)
        self._dirty = True
        self._redraw()

    def _show_stats(self, s: GenerationStats) -> None:
        """The figures of an answer, live or final: the engine's own ``GenerationStats``."""
        self.tok_s.value.setText(f"{s.tok_per_s:.1f}" if s.n_new > 1 else "…")
        self.ttft.value.setText(f"{s.ttft_s * 1000:.0f} ms")
        drafting = not is_plain(s.drafter)
        self.tau.value.setText(f"{s.mean_accepted:.2f}" if drafting else "1 (plain)")
        self.accept.value.setText(f"{s.acceptance_rate:.0%}" if drafting and any(
            st.n_proposed for st in s.steps) else "–")
        self.acceptance.set_counts(s.acceptance_by_depth(MAX_DRAFT_LIMIT))

    def on_failed(self) -> None:
        self._live = False
        self.compare_button.setEnabled(True)

    def on_compared(self, c: Comparison) -> None:
        self.compare_button.setEnabled(True)
        a, b = c.stats_dft.tok_per_s, c.stats_plain.tok_per_s
        self.comparison.set_values([(c.drafter, a), ("plain", b)])
        ratio = f"{a / b:.2f}x" if b > 0 else "n/a"
        same = "identical output" if c.identical else "outputs differ (sampling)"
        self.compare_result.setText(f"{c.drafter}: {a:.1f} tok/s, plain: {b:.1f} tok/s, "
                                    f"speed-up {ratio}; {same}.")

    def set_loop_lag(self, lag: LoopLag) -> None:
        self.lag.value.setText(f"{lag.max_ms:.0f} / {lag.p95_ms:.0f} ms"
                               if lag.n_ticks else "–")

    # --- drawing ---------------------------------------------------------------------
    def _redraw(self) -> None:
        if not self._dirty or not self.isVisible():
            return
        self._dirty = self._live  # keep the timeline moving while an answer streams
        ev = self._events
        if self._live and ev:
            self._show_stats(GenerationStats.so_far([e.step for e in ev], self._drafter,
                                                    ev[0].t_draft_start - self._t_start,
                                                    ev[-1].t_end - self._t_start))
        if self._t_start:
            t_last = ev[-1].t_end if ev else time.perf_counter()
            samples = [s for s in self.sampler.samples
                       if self._t_start - 0.5 <= s[0] <= t_last + 0.5]
            phases = [(e.t_draft_start, e.t_verify_start, e.t_end) for e in ev]
            self.timeline.set_data(self._t_start, samples, phases, self.gpu)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "." if text else ""


def _guarantee(text: str) -> str:
    return f"Output: {text}." if text else ""


def _budget_text(budget: dict) -> str:
    from engine.planning.planner import Budget

    return Budget(**budget).describe()


def _memory(ready: EngineReady) -> str:
    """``Memory: 1.2 GiB (...). `` for the plan's reason, or nothing."""
    return f"Memory: {ready.memory}. " if ready.memory else ""
