"""Model, draft head and drafter: app-wide choices, remembered in the store."""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.conversation_store import ConversationStore
from app.gui.engine_worker import EngineChoice, EngineReady

log = logging.getLogger(__name__)

DRAFTER_LABELS = {
    "auto": "Auto (the planner decides)",
    "head": "Draft head",
    "lookup": "Prompt lookup",
    "none": "None (plain decoding)",
}


def _registry_models() -> list:
    """Available models of the wizard's registry; none when it cannot be read."""
    try:
        from engine.hub.local_models import ModelRegistry

        return [m for m in ModelRegistry().list() if m.available]
    except Exception:  # a broken registry must not keep the window from opening
        log.warning("cannot read the local model registry", exc_info=True)
        return []


def is_head_dir(path: Path) -> bool:
    return (path / "head.json").is_file() and (path / "head.safetensors").is_file()


class EnginePanel(QGroupBox):
    """Emits ``choice_changed`` when the user picks another model, head or drafter."""

    choice_changed = Signal(object)  # EngineChoice

    def __init__(self, store: ConversationStore, parent: QWidget | None = None) -> None:
        super().__init__("Model and drafting (all conversations)", parent)
        self.store = store
        self.model_box = QComboBox()
        self.head_box = QComboBox()
        self.drafter_box = QComboBox()
        for key, label in DRAFTER_LABELS.items():
            self.drafter_box.addItem(label, key)
        add_model = QPushButton("Add GGUF…")
        add_model.clicked.connect(self._add_model)
        add_head = QPushButton("Add head…")
        add_head.clicked.connect(self._add_head)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_box, 1)
        model_row.addWidget(add_model)
        head_row = QHBoxLayout()
        head_row.addWidget(self.head_box, 1)
        head_row.addWidget(add_head)
        form = QFormLayout()
        form.addRow("Model", model_row)
        form.addRow("Drafter", self.drafter_box)
        form.addRow("Draft head", head_row)
        self.state = QLabel("Starting…")
        self.state.setWordWrap(True)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setStyleSheet("color: #9a5b00;")
        self.note.hide()
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.state)
        layout.addWidget(self.note)
        self._fill()
        for box in (self.model_box, self.head_box, self.drafter_box):
            box.activated.connect(self._changed)

    def _fill(self) -> None:
        """(Re)list the models: the bundled one, GGUF files the user added, and models
        the model wizard downloaded or imported (with their draft heads)."""
        models = list(self.store.get_setting("models", []))
        heads = list(self.store.get_setting("heads", []))
        self.model_heads: dict[str, str] = {}
        for m in _registry_models():
            if m.path not in models:
                models.append(m.path)
            if m.head_dir:
                self.model_heads[m.path] = m.head_dir
                if m.head_dir not in heads:
                    heads.append(m.head_dir)
        self.model_box.clear()
        self.model_box.addItem("SmolLM2-135M-Instruct (bundled)", "")
        for p in models:
            self.model_box.addItem(Path(p).name, p)
        self.head_box.clear()
        self.head_box.addItem("Bundled head (SmolLM2)", "")
        for p in heads:
            self.head_box.addItem(Path(p).name, p)
        self._select(self.model_box, self.store.get_setting("model", ""))
        self._select(self.head_box, self.store.get_setting("head", ""))
        self._select(self.drafter_box, self.store.get_setting("drafter", "auto"))

    @staticmethod
    def _select(box: QComboBox, value: object) -> None:
        i = box.findData(value)
        box.setCurrentIndex(max(0, i))

    def choice(self) -> EngineChoice:
        model = self.model_box.currentData() or None
        head = self.head_box.currentData() or None
        return EngineChoice(model_path=Path(model) if model else None,
                            drafter=self.drafter_box.currentData() or "auto",
                            head_dir=Path(head) if head else None)

    def _changed(self, *_: object) -> None:
        model = self.model_box.currentData() or ""
        if self.sender() is self.model_box and model in self.model_heads:
            # A model that came with a head drafts with it unless the user says otherwise.
            self._select(self.head_box, self.model_heads[model])
        self.store.set_setting("model", model)
        self.store.set_setting("head", self.head_box.currentData() or "")
        self.store.set_setting("drafter", self.drafter_box.currentData() or "auto")
        self.choice_changed.emit(self.choice())

    def _remember(self, key: str, path: str) -> None:
        items = list(self.store.get_setting(key, []))
        if path not in items:
            items.append(path)
            self.store.set_setting(key, items)

    def add_model(self, path: Path, head_dir: Path | None = None) -> None:
        """Offer a local GGUF file and switch to it (and to ``head_dir`` when given)."""
        self._remember("models", str(path))
        self.store.set_setting("model", str(path))
        if head_dir is not None:
            self._remember("heads", str(head_dir))
            self.store.set_setting("head", str(head_dir))
        self._fill()
        self._changed()

    def add_head(self, path: Path) -> None:
        """Offer a head folder (head.json + head.safetensors) and draft with it."""
        self._remember("heads", str(path))
        self.store.set_setting("head", str(path))
        drafter = self.drafter_box.currentData() or "auto"
        self.store.set_setting("drafter", "head" if drafter in ("none", "lookup") else drafter)
        self._fill()
        self._changed()

    def _add_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Add a GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf)")
        if path:
            self.add_model(Path(path))

    def _add_head(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Add a draft head folder",
                                                str(Path.home()))
        if not path:
            return
        if not is_head_dir(Path(path)):
            QMessageBox.warning(self, "Not a draft head",
                                f"{path} has no head.json and head.safetensors.")
            return
        self.add_head(Path(path))

    # --- engine state ----------------------------------------------------------------
    def show_loading(self, text: str) -> None:
        self.state.setText(text)

    def show_ready(self, ready: EngineReady) -> None:
        self.state.setText(f"Ready: {Path(ready.model_path).name}, drafter "
                           f"{ready.drafter}, {ready.n_threads} CPU threads, context "
                           f"{ready.n_ctx} tokens.")
        self.note.setText(ready.note)
        self.note.setVisible(bool(ready.note))

    def show_failure(self, message: str) -> None:
        self.state.setText(f"Could not load the model: {message}")
        self.note.hide()
