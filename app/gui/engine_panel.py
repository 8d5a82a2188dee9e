"""Model, drafter and what drafts (a head or a draft model): app-wide choices,
remembered in the store.

The draft selector lists draft heads and the draft models that can draft for the chosen
model: GGUFs on this machine whose header passes llama.cpp's vocabulary rules against
the model's and weigh at most a quarter of it (engine.hub.draft_pairing; header reads
only, cached per file, so this runs on the UI thread). An incompatible one is never
listed."""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.conversation_store import ConversationStore
from app.gui import theme
from app.gui.engine_worker import EngineChoice, EngineReady
from app.gui.measure_bar import MeasureBar
from engine.drafters.kinds import OFFERED, DrafterKind
from engine.errors import InvalidSettingError
from engine.gguf.eagle3 import is_eagle3_head
from engine.hub.draft_pairing import (
    BUNDLED_DRAFT_FILE,
    LocalDraft,
    compatible_local_drafts,
    local_candidates,
)
from engine.hub.fit import human_bytes
from engine.hub.local_models import ModelRegistry
from engine.hub.model_store import PREPARED_FILE
from engine.planning.drafter_options import DrafterOption, drafter_options
from engine.planning.measure_progress import Measuring
from engine.runtime.model_info import read_model_info
from engine.workers.endpoints import parse_workers

log = logging.getLogger(__name__)

DRAFT_PREFIX = "draft:"  # the selector's data for a draft model, beside head paths


def _registry_models() -> list:
    """Available models of the wizard's registry; none when it cannot be read."""
    try:
        return [m for m in ModelRegistry().list() if m.available]
    except Exception:  # a broken registry must not keep the window from opening
        log.warning("cannot read the local model registry", exc_info=True)
        return []


def _compatible_drafts(model: str, extra: list[str]) -> list[LocalDraft]:
    """The local draft models for ``model`` ("" = the bundled one); none when its
    header cannot be read."""
    registry = ModelRegistry()
    target = Path(model) if model else registry.path.parent / BUNDLED_DRAFT_FILE
    try:
        if not target.is_file():
            return []
        return compatible_local_drafts(target, local_candidates(registry, extra))
    except Exception:  # a bad file must not keep the window from opening
        log.warning("cannot list draft models for %s", target, exc_info=True)
        return []


def _drafter_options(model: str, extra: list[str], heads: list[str]
                     ) -> dict[DrafterKind, DrafterOption]:
    """What ``model`` ("" = the bundled one) can draft with, by drafter name; nothing
    when its header cannot be read (every drafter then stays offered)."""
    from engine.hub.model_store import default_model_path

    registry = ModelRegistry()
    try:
        path = Path(model) if model else default_model_path()
        head = next((Path(h) for h in heads if Path(h).is_dir()), None)
        options = drafter_options(read_model_info(path), local_candidates(registry, extra),
                                  head_dir=head)
    except Exception:  # a bad file must not keep the window from opening
        log.warning("cannot list drafters for %s", model or "the bundled model",
                    exc_info=True)
        return {}
    return {o.drafter: o for o in options}


def is_head_dir(path: Path) -> bool:
    return (path / "head.json").is_file() and (path / "head.safetensors").is_file()


class EnginePanel(QGroupBox):
    """Emits ``choice_changed`` when the user picks another model, head or drafter.
    The model and drafter boxes live in ``picker``, a bar the window puts above the
    chat; the group itself (what drafts, workers, the engine's state) goes with the
    settings."""

    choice_changed = Signal(object)  # EngineChoice

    def __init__(self, store: ConversationStore, parent: QWidget | None = None) -> None:
        super().__init__("Drafting and workers (all conversations)", parent)
        self.store = store
        self.default_model: Path | None = None  # what the bundled entry opens, if not it
        self.model_box = QComboBox()
        self.head_box = QComboBox()
        self.drafter_box = QComboBox()
        for kind in OFFERED:  # the drafters the engine offers
            self.drafter_box.addItem(kind.label, kind.value)
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
        # Another machine's memory and compute for the target (`tandem worker` there).
        self.workers_edit = QLineEdit(self.store.get_setting("workers", ""))
        self.workers_edit.setPlaceholderText("none (this computer), or HOST:PORT")
        self.workers_edit.setToolTip(
            "The target's layers and KV cache run on these workers; drafts are made here. "
            "The protocol has no authentication: use a worker on this machine or one "
            "reached through an SSH tunnel.")
        self.workers_edit.editingFinished.connect(self._workers_edited)
        self.picker = QWidget()
        picker = QHBoxLayout(self.picker)
        picker.setContentsMargins(0, 0, 0, 0)
        model_label, drafter_label = QLabel("&Model"), QLabel("&Drafter")
        model_label.setBuddy(self.model_box)
        drafter_label.setBuddy(self.drafter_box)
        self.model_box.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_box.setMinimumContentsLength(16)
        self.drafter_box.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.drafter_box.setMinimumContentsLength(14)
        picker.addWidget(model_label)
        picker.addLayout(model_row, 3)
        picker.addSpacing(8)
        picker.addWidget(drafter_label)
        picker.addWidget(self.drafter_box, 2)
        form = QFormLayout()
        form.addRow("Drafts with", head_row)
        form.addRow("Workers", self.workers_edit)
        self.state = QLabel("Starting…")
        self.state.setWordWrap(True)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setStyleSheet(f"color: {theme.current().note};")
        self.note.hide()
        # The first start's measurement of this machine (the window places it in sight).
        self.measure_bar = MeasureBar()
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.state)
        layout.addWidget(self.note)
        self._fill()
        for box in (self.model_box, self.head_box, self.drafter_box):
            box.activated.connect(self._changed)

    def _fill(self) -> None:
        """(Re)list the models: the bundled one, GGUF files the user added, and models
        the model wizard downloaded or imported (with their draft heads and drafts)."""
        models = list(self.store.get_setting("models", []))
        self.model_heads: dict[str, str] = {}
        self.model_drafts: dict[str, str] = {}
        for m in _registry_models():
            if m.path not in models:
                models.append(m.path)
            if m.head_dir:
                self.model_heads[m.path] = m.head_dir
            if m.draft_path:
                self.model_drafts[m.path] = m.draft_path
        self.model_box.clear()
        self.model_box.addItem("SmolLM2-135M-Instruct (bundled)", "")
        for p in models:
            self.model_box.addItem(Path(p).name, p)
        self._select(self.model_box, self.store.get_setting("model", ""))
        self._fill_drafts()
        self._select(self.drafter_box, self.store.get_setting("drafter", DrafterKind.AUTO))

    def _fill_drafts(self) -> None:
        """(Re)list what can draft for the selected model: heads, then draft models."""
        heads = list(self.store.get_setting("heads", []))
        heads += [h for h in self.model_heads.values() if h not in heads]
        self.head_box.clear()
        self.head_box.addItem("Bundled head (SmolLM2)", "")
        for p in heads:
            self.head_box.addItem(Path(p).name + (" (EAGLE-3)" if is_eagle3_head(p) else ""),
                                  p)
        model = self.model_box.currentData() or ""
        for d in _compatible_drafts(model, list(self.store.get_setting("models", []))):
            self.head_box.addItem(f"{d.name} (draft model, {human_bytes(d.n_bytes)})",
                                  DRAFT_PREFIX + d.path)
        draft = self.store.get_setting("draft_model", "")
        if not (draft and self.head_box.findData(DRAFT_PREFIX + draft) >= 0):
            draft = ""
        self._select(self.head_box, DRAFT_PREFIX + draft if draft
                     else self.store.get_setting("head", ""))
        self._mark_drafters(model, heads)

    def _mark_drafters(self, model: str, heads: list[str]) -> None:
        """Grey out the drafters this model cannot use, the reason as their tooltip."""
        options = _drafter_options(model, list(self.store.get_setting("models", [])), heads)
        self.drafter_options = options
        items = self.drafter_box.model()
        for i in range(self.drafter_box.count()):
            option = options.get(self.drafter_box.itemData(i))
            usable = option is None or option.available
            items.item(i).setEnabled(usable)  # type: ignore[attr-defined]
            self.drafter_box.setItemData(
                i, None if option is None else
                option.detail if usable else f"Not offered: {option.detail}",
                Qt.ItemDataRole.ToolTipRole)
        current = self._drafter()
        if current in options and not options[current].available:
            self._select(self.drafter_box, DrafterKind.AUTO)

    @staticmethod
    def _select(box: QComboBox, value: object) -> None:
        # A kind is found by its name (the box's data, and a saved setting's).
        i = box.findData(str(value) if isinstance(value, DrafterKind) else value)
        box.setCurrentIndex(max(0, i))

    def _drafter(self) -> DrafterKind:
        """The drafter the box names (auto when it names none the engine knows)."""
        return DrafterKind.of(self.drafter_box.currentData()) or DrafterKind.AUTO

    def _selected_draft(self) -> Path | None:
        data = self.head_box.currentData() or ""
        return Path(data[len(DRAFT_PREFIX):]) if data.startswith(DRAFT_PREFIX) else None

    def choice(self) -> EngineChoice:
        """What the boxes say. A draft model selected runs the draft drafter (or is
        weighed by auto); a head selected runs a head drafter."""
        model = self.model_box.currentData() or None
        drafter = self._drafter()
        draft = self._selected_draft()
        head = None if draft else (self.head_box.currentData() or None)
        eagle3_head = bool(head) and is_eagle3_head(head)
        if draft is not None and drafter is DrafterKind.HEAD:
            drafter = DrafterKind.DRAFT
        elif draft is None and drafter is DrafterKind.DRAFT:
            drafter = DrafterKind.HEAD
        elif eagle3_head and drafter is DrafterKind.HEAD:
            drafter = DrafterKind.EAGLE3  # an EAGLE-3 head selected drafts as one
        if drafter is DrafterKind.EAGLE3 and not eagle3_head:
            head = None  # the engine finds one that fits (imported, or the bundled one)
        elif drafter is DrafterKind.HEAD and eagle3_head:
            head = None
        return EngineChoice(model_path=Path(model) if model else None, drafter=drafter,
                            head_dir=Path(head) if head else None, draft_model=draft,
                            workers=self._workers())

    def _workers(self) -> tuple[str, ...]:
        try:
            return parse_workers(self.workers_edit.text())
        except InvalidSettingError:
            return ()  # _workers_edited said why

    def _workers_edited(self) -> None:
        text = self.workers_edit.text().strip()
        if text == self.store.get_setting("workers", ""):
            return
        try:
            parse_workers(text)
        except InvalidSettingError as exc:
            self.note.setText(f"Workers: {exc.named('Workers')}")
            self.note.show()
            return
        self.store.set_setting("workers", text)
        self.choice_changed.emit(self.choice())

    def _changed(self, *_: object) -> None:
        model = self.model_box.currentData() or ""
        if self.sender() is self.model_box:
            # Another model: other drafts fit it. One that came with a draft drafts with
            # it (or with its head) unless the user says otherwise.
            self._fill_drafts()
            paired = self.model_drafts.get(model)
            if paired and self.head_box.findData(DRAFT_PREFIX + paired) >= 0:
                self._select(self.head_box, DRAFT_PREFIX + paired)
            elif model in self.model_heads:
                self._select(self.head_box, self.model_heads[model])
        elif self.sender() is self.head_box and self._selected_draft() is not None:
            # Choosing a draft model means drafting with it.
            self._select(self.drafter_box, DrafterKind.DRAFT)
        elif self.sender() is self.head_box and is_eagle3_head(self.head_box.currentData()
                                                               or ""):
            self._select(self.drafter_box, DrafterKind.EAGLE3)  # and an EAGLE-3 head, with it
        elif (self.sender() is self.drafter_box and self._drafter() is DrafterKind.DRAFT
              and self._selected_draft() is None):
            # "Draft model" asked for: the first one listed (none listed: a head drafts).
            first = next((i for i in range(self.head_box.count())
                          if str(self.head_box.itemData(i)).startswith(DRAFT_PREFIX)), -1)
            if first >= 0:
                self.head_box.setCurrentIndex(first)
        choice = self.choice()
        self._select(self.drafter_box, choice.drafter)
        self.store.set_setting("model", model)
        if choice.draft_model is None:
            self.store.set_setting("head", self.head_box.currentData() or "")
        self.store.set_setting("draft_model", str(choice.draft_model or ""))
        self.store.set_setting("drafter", str(choice.drafter))
        self.choice_changed.emit(choice)

    def _remember(self, key: str, path: str) -> None:
        items = list(self.store.get_setting(key, []))
        if path not in items:
            items.append(path)
            self.store.set_setting(key, items)

    def add_model(self, path: Path, head_dir: Path | None = None,
                  draft_path: Path | None = None) -> None:
        """Offer a local GGUF file and switch to it (and to ``head_dir`` or the paired
        ``draft_path`` when given: the draft is selected when it is compatible)."""
        self._remember("models", str(path))
        self.store.set_setting("model", str(path))
        if head_dir is not None:
            self._remember("heads", str(head_dir))
            self.store.set_setting("head", str(head_dir))
        self.store.set_setting("draft_model", str(draft_path) if draft_path else "")
        self._fill()
        self._changed()

    def add_head(self, path: Path) -> None:
        """Offer a head (a folder with head.json + head.safetensors, or an EAGLE-3 GGUF)
        and draft with it."""
        self._remember("heads", str(path))
        self.store.set_setting("head", str(path))
        self.store.set_setting("draft_model", "")
        drafter = self._drafter()
        if is_eagle3_head(path):
            drafter = DrafterKind.EAGLE3
        elif drafter is not DrafterKind.AUTO:  # a torch head drafts as one, whatever was chosen
            drafter = DrafterKind.HEAD
        self.store.set_setting("drafter", str(drafter))
        self._fill()
        self._changed()

    def _add_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Add a GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf)")
        if path:
            self.add_model(Path(path))

    def _add_head(self) -> None:
        """A torch head (its head.json picks the folder) or an EAGLE-3 GGUF (converted
        with `tandem models import-eagle3`, or written by train-draft)."""
        path, _ = QFileDialog.getOpenFileName(
            self, "Add a draft head: its head.json, or an EAGLE-3 .gguf", str(Path.home()),
            "Draft heads (head.json *.gguf)")
        if not path:
            return
        chosen = Path(path)
        if is_eagle3_head(chosen):
            self.add_head(chosen)
            return
        if chosen.suffix == ".gguf":  # picked as a head GGUF: say how to make one
            QMessageBox.warning(self, "Not an EAGLE-3 head",
                                f"{chosen.name} is not an EAGLE-3 head GGUF (architecture "
                                "eagle3). A public head's safetensors folder converts with "
                                "`tandem models import-eagle3 FOLDER --model MODEL`.")
            return
        if not is_head_dir(chosen.parent):
            QMessageBox.warning(self, "Not a draft head",
                                f"{chosen.parent} has no head.json and head.safetensors.")
            return
        self.add_head(chosen.parent)

    # --- engine state ----------------------------------------------------------------
    def show_loading(self, text: str) -> None:
        self.state.setText(text)

    def show_measuring(self, progress: Measuring) -> None:
        """How far measuring this machine is, and about how long is left."""
        self.measure_bar.show_progress(progress)

    def show_ready(self, ready: EngineReady) -> None:
        self.measure_bar.finish()
        threads = f"{ready.n_threads} CPU thread{'s' * (ready.n_threads != 1)}"
        self.state.setText(f"Ready: {Path(ready.model_path).name}, drafter "
                           f"{ready.drafter}, {threads}, context {ready.n_ctx} tokens.")
        self.note.setText(ready.note)
        self.note.setVisible(bool(ready.note))
        self._show_loaded_model(ready.model_path)

    def _show_loaded_model(self, path: str) -> None:
        """The model box names the file that is loaded (the bundled entry only for the
        bundled model), listing it when the box did not have it."""
        bundled = (self.default_model is not None and Path(path) == self.default_model) \
            or Path(path).name == PREPARED_FILE
        key = "" if bundled else path
        index = self.model_box.findData(key)
        if index < 0:
            self.model_box.addItem(Path(path).name, path)
            index = self.model_box.count() - 1
        self.model_box.blockSignals(True)
        self.model_box.setCurrentIndex(index)
        self.model_box.blockSignals(False)

    def show_failure(self, message: str) -> None:
        self.measure_bar.finish()
        self.state.setText(f"Could not load the model: {message}")
        self.note.hide()
