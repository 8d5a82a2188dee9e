"""Per-conversation settings: system prompt and sampling."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.conversation_store import ChatSettings

POLICY_LABELS = {"drop_oldest": "Drop the oldest turns", "stop": "Stop at the limit"}


def _number_box(low: float, high: float, step: float, at_low: str = "") -> QDoubleSpinBox:
    """A spin box for a sampling value; ``at_low`` is shown instead of the lowest value."""
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    if at_low:
        box.setSpecialValueText(at_low)
    return box


class SettingsPanel(QGroupBox):
    """Shows one conversation's settings; emits ``changed`` on every user edit (not on
    ``show_settings``)."""

    changed = Signal(str, object)  # system prompt, ChatSettings

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("This conversation", parent)
        self._loading = False
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional)")
        self.system_prompt.setFixedHeight(64)
        self.temperature = _number_box(0.0, 2.0, 0.1, "0 (greedy)")
        self.top_p = _number_box(0.01, 1.0, 0.05)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setSpecialValueText("off")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 8192)
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.min_p = _number_box(0.0, 0.99, 0.01, "off")
        self.repeat_penalty = _number_box(1.0, 2.0, 0.05, "off")
        self.repeat_penalty.setToolTip("Penalise tokens of the last 64: small models loop "
                                       "without it")
        self.frequency_penalty = _number_box(-2.0, 2.0, 0.1)
        self.presence_penalty = _number_box(-2.0, 2.0, 0.1)
        self.context_policy = QComboBox()
        for policy, label in POLICY_LABELS.items():
            self.context_policy.addItem(label, policy)
        self.context_policy.setToolTip("What happens when this chat no longer fits the "
                                       "model's context")
        self.thinking = QCheckBox("Think before answering")
        self.thinking.setChecked(True)
        self.set_thinking_switch(False)
        self.answer_json = QCheckBox("Answer as JSON")
        self.answer_json.setToolTip("Every answer is JSON: any object, or one matching the "
                                    "schema below (drafted answers stay the same)")
        self.json_schema = QPlainTextEdit()
        self.json_schema.setPlaceholderText('JSON schema (optional), e.g. {"type": "object", '
                                            '"properties": {"city": {"type": "string"}}}')
        self.json_schema.setFixedHeight(64)
        self.json_schema.setEnabled(False)
        self.use_tools = QCheckBox("Offer the tool servers' tools")
        self.use_tools.setToolTip("The model may call the tools of the running MCP servers "
                                  "(Tools, below); you approve each call")
        self.tool_rounds = QSpinBox()
        self.tool_rounds.setRange(0, 50)
        self.tool_rounds.setToolTip("Answers in a row that may call tools; then the model "
                                    "answers with what it has")
        self.tools_required = QCheckBox("Every answer calls a tool (up to the rounds)")
        self.tools_required.setToolTip("For models that do not call tools on their own: "
                                       "each answer is a call, held by a grammar")
        form = QFormLayout()
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repetition penalty", self.repeat_penalty)
        form.addRow("Frequency penalty", self.frequency_penalty)
        form.addRow("Presence penalty", self.presence_penalty)
        form.addRow("Long chats", self.context_policy)
        form.addRow("Thinking", self.thinking)
        form.addRow("Format", self.answer_json)
        tools = QFormLayout()
        tools.addRow("Tools", self.use_tools)
        tools.addRow("Tool rounds", self.tool_rounds)
        tools.addRow("", self.tools_required)
        layout = QVBoxLayout(self)
        layout.addWidget(self.system_prompt)
        layout.addLayout(form)
        layout.addWidget(self.json_schema)
        layout.addLayout(tools)
        self.system_prompt.textChanged.connect(self._emit)
        for box in (self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed,
                    self.min_p, self.repeat_penalty, self.frequency_penalty,
                    self.presence_penalty, self.tool_rounds):
            box.valueChanged.connect(self._emit)
        self.use_tools.toggled.connect(self._emit)
        self.tools_required.toggled.connect(self._emit)
        self.context_policy.currentIndexChanged.connect(self._emit)
        self.thinking.toggled.connect(self._emit)
        self.answer_json.toggled.connect(self.json_schema.setEnabled)
        self.answer_json.toggled.connect(self._emit)
        self.json_schema.textChanged.connect(self._emit)
        self.show_settings("", ChatSettings())

    def show_settings(self, system_prompt: str, settings: ChatSettings) -> None:
        self._loading = True
        try:
            self.system_prompt.setPlainText(system_prompt)
            self.temperature.setValue(settings.temperature)
            self.top_p.setValue(settings.top_p)
            self.top_k.setValue(settings.top_k)
            self.max_tokens.setValue(settings.max_tokens)
            self.seed.setValue(-1 if settings.seed is None else settings.seed)
            self.min_p.setValue(settings.min_p)
            self.repeat_penalty.setValue(settings.repeat_penalty)
            self.frequency_penalty.setValue(settings.frequency_penalty)
            self.presence_penalty.setValue(settings.presence_penalty)
            self.context_policy.setCurrentIndex(
                max(0, self.context_policy.findData(settings.context_policy)))
            self.thinking.setChecked(settings.thinking)
            self.answer_json.setChecked(settings.answer_json)
            self.json_schema.setPlainText(settings.json_schema)
            self.use_tools.setChecked(settings.use_tools)
            self.tool_rounds.setValue(settings.tool_rounds)
            self.tools_required.setChecked(settings.tool_choice == "required")
        finally:
            self._loading = False

    def settings(self) -> ChatSettings:
        seed = self.seed.value()
        return ChatSettings(temperature=round(self.temperature.value(), 4),
                            top_p=round(self.top_p.value(), 4), top_k=self.top_k.value(),
                            max_tokens=self.max_tokens.value(),
                            seed=None if seed < 0 else seed,
                            min_p=round(self.min_p.value(), 4),
                            repeat_penalty=round(self.repeat_penalty.value(), 4),
                            frequency_penalty=round(self.frequency_penalty.value(), 4),
                            presence_penalty=round(self.presence_penalty.value(), 4),
                            context_policy=self.context_policy.currentData(),
                            thinking=self.thinking.isChecked(),
                            answer_json=self.answer_json.isChecked(),
                            json_schema=self.json_schema.toPlainText().strip(),
                            use_tools=self.use_tools.isChecked(),
                            tool_rounds=self.tool_rounds.value(),
                            tool_choice="required" if self.tools_required.isChecked()
                            else "auto")

    def set_thinking_switch(self, available: bool) -> None:
        """Offer the thinking switch only where the model's chat template has one."""
        self.thinking.setEnabled(available)
        self.thinking.setToolTip(
            "This model's chat template can turn its thinking off" if available else
            "This model's chat template has no thinking switch (enable_thinking)")

    def _emit(self) -> None:
        if not self._loading:
            self.changed.emit(self.system_prompt.toPlainText(), self.settings())
