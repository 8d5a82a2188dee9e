"""The model wizard: search the Hub, pick a quantization that fits, download target,
draft head and draft model as one job (pause, resume, cancel), import a local GGUF, see
local models. Each quantization shows the draft model paired with it (checked against
its vocabulary before download) and the fit of both together.

All Hub work runs in a HubWorker moved to a QThread; this dialog only sends requests by
signal and shows what comes back, so the window never freezes on the network."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QThread, Signal, Slot
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDialog,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.gui.model_wizard_worker import DownloadRequest, HubFailure, HubWorker, RepoDetails
from engine.errors import ModelLoadError
from engine.hub.catalog import load_catalog
from engine.hub.download import DownloadControl, DownloadProgress
from engine.hub.draft_catalog import load_draft_catalog
from engine.hub.draft_pairing import DraftOffer
from engine.hub.fit import TOO_LARGE, FitEstimate, MachineMemory, human_bytes
from engine.hub.local_models import LocalModel, ModelRegistry, import_gguf

FILE_COLUMNS = ["quant", "size", "fit", "draft model", "file"]
FIT_COLUMN, DRAFT_COLUMN = 2, 3


class ModelWizardDialog(QDialog):
    """Get models. ``hub_endpoint``/``cache_dir``/``registry`` default to the Hub, the
    huggingface_hub cache and Tandem's model list; tests point them at a local server.
    ``model_added`` carries the LocalModel of each finished download or import."""

    model_added = Signal(object)  # LocalModel
    search_request = Signal(str)
    list_request = Signal(str, int)
    download_request = Signal(object)  # DownloadRequest

    def __init__(self, parent: QWidget | None = None, hub_endpoint: str | None = None,
                 cache_dir: Path | None = None, registry: ModelRegistry | None = None,
                 memory: MachineMemory | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Get models")
        self.resize(900, 640)
        self.registry = registry or ModelRegistry()
        self.details: RepoDetails | None = None
        self.control: DownloadControl | None = None
        self._build()
        data_dir = self.registry.path.parent.parent  # <home>/models/models.json
        self.worker = HubWorker(hub_endpoint, cache_dir, self.registry, load_catalog(data_dir),
                                memory, load_draft_catalog(data_dir))
        self.thread_ = QThread(self)
        self.thread_.setObjectName("model-wizard-hub")
        self.worker.moveToThread(self.thread_)
        self.thread_.finished.connect(self.worker.deleteLater)
        self.search_request.connect(self.worker.search)
        self.list_request.connect(self.worker.list_repo)
        self.download_request.connect(self.worker.download)
        self.worker.searched.connect(self._on_searched)
        self.worker.listed.connect(self._on_listed)
        self.worker.progress.connect(self._on_progress)
        self.worker.installed.connect(self._on_installed)
        self.worker.failed.connect(self._on_failed)
        self.thread_.start()
        self.finished.connect(self.shutdown)
        self._refresh_local()

    # --- layout ------------------------------------------------------------------------
    def _build(self) -> None:
        self.query = QLineEdit(placeholderText="Search GGUF models on the Hugging Face Hub")
        self.search_button = QPushButton("Search")
        self.ctx = QSpinBox(minimum=512, maximum=1 << 20, singleStep=1024, value=4096)
        self.ctx.setPrefix("context ")
        top = QHBoxLayout()
        for w in (self.query, self.search_button, self.ctx):
            top.addWidget(w)

        self.repos = QListWidget()
        self.files = QTableWidget(0, len(FILE_COLUMNS))
        self.files.setHorizontalHeaderLabels(FILE_COLUMNS)
        self.files.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.files.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.files.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.files.horizontalHeader().setStretchLastSection(True)
        self.heads = QComboBox()
        self.drafts = QComboBox()
        self.draft_note = QLabel()
        self.draft_note.setWordWrap(True)

        self.download_button = QPushButton("Download")
        self.pause_button = QPushButton("Pause")
        self.cancel_button = QPushButton("Cancel")
        self.keep_partial = QCheckBox("keep the partial download to resume later")
        self.keep_partial.setChecked(True)
        self.progress_bar = QProgressBar()
        self.status = QLabel("Search for a model to begin.")
        self.status.setWordWrap(True)
        actions = QHBoxLayout()
        for w in (self.download_button, self.pause_button, self.cancel_button,
                  self.keep_partial):
            actions.addWidget(w)
        actions.addStretch(1)

        self.local = QListWidget()
        self.import_button = QPushButton("Import GGUF file…")
        self.close_button = QPushButton("Close")

        grid = QGridLayout()
        grid.addWidget(QLabel("Repositories"), 0, 0)
        grid.addWidget(QLabel("Models in the repository"), 0, 1)
        grid.addWidget(self.repos, 1, 0)
        grid.addWidget(self.files, 1, 1)
        grid.setColumnStretch(1, 2)
        heads_row = QHBoxLayout()
        heads_row.addWidget(QLabel("Draft head"))
        heads_row.addWidget(self.heads, 1)
        heads_row.addWidget(QLabel("Draft model"))
        heads_row.addWidget(self.drafts, 1)
        bottom = QHBoxLayout()
        bottom.addWidget(self.import_button)
        bottom.addStretch(1)
        bottom.addWidget(self.close_button)

        root = QVBoxLayout(self)
        root.addLayout(top)
        root.addLayout(grid, 3)
        root.addLayout(heads_row)
        root.addWidget(self.draft_note)
        root.addLayout(actions)
        root.addWidget(self.progress_bar)
        root.addWidget(self.status)
        root.addWidget(QLabel("Models on this machine"))
        root.addWidget(self.local, 1)
        root.addLayout(bottom)

        self.search_button.clicked.connect(self.start_search)
        self.query.returnPressed.connect(self.start_search)
        self.repos.currentItemChanged.connect(self._on_repo_selected)
        self.files.itemSelectionChanged.connect(self._on_row_selected)
        self.heads.activated.connect(self._update_fit)
        self.drafts.activated.connect(self._update_fit)
        self.download_button.clicked.connect(self.start_download)
        self.pause_button.clicked.connect(self.toggle_pause)
        self.cancel_button.clicked.connect(self.cancel_download)
        self.import_button.clicked.connect(self._ask_import)
        self.close_button.clicked.connect(self.reject)
        self._set_busy(False)

    # --- requests ----------------------------------------------------------------------
    @Slot()
    def start_search(self) -> None:
        self.status.setText(f"Searching for “{self.query.text()}”…")
        self.repos.clear()
        self.search_request.emit(self.query.text().strip())

    @Slot()
    def _on_repo_selected(self) -> None:
        item = self.repos.currentItem()
        if item is None:
            return
        self.files.setRowCount(0)
        self.heads.clear()
        self.drafts.clear()
        self.draft_note.clear()
        self.details = None
        self.status.setText(f"Reading {item.text()}…")
        self.list_request.emit(item.data(Qt.ItemDataRole.UserRole), self.ctx.value())

    @Slot()
    def start_download(self) -> None:
        row = self.files.currentRow()
        if self.details is None or row < 0 or self.control is not None:
            return
        choice = self.details.rows[row].choice
        head = self.heads.currentData()
        draft = self.drafts.currentData()
        self.control = DownloadControl()
        self._set_busy(True)
        self.progress_bar.setValue(0)
        extra = f" with the draft {draft.label}" if draft is not None else ""
        self.status.setText(f"Downloading {choice.name}{extra}…")
        self.download_request.emit(DownloadRequest(choice, head, self.control, draft))

    @Slot()
    def toggle_pause(self) -> None:
        if self.control is None:
            return
        if self.control.paused:
            self.control.resume()
            self.pause_button.setText("Pause")
        else:
            self.control.pause()
            self.pause_button.setText("Resume")

    @Slot()
    def cancel_download(self) -> None:
        if self.control is not None:
            self.control.cancel(keep_partial=self.keep_partial.isChecked())

    @Slot()
    def _ask_import(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import a GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.import_file(Path(path))

    def import_file(self, path: Path) -> LocalModel | None:
        """Register a local GGUF (checked first); the status line says why one is refused.
        Reading a header is quick, so this runs on the UI thread."""
        try:
            model = import_gguf(path, self.registry)
        except ModelLoadError as exc:
            self.status.setText(f"Not imported: {exc}")
            return None
        self.status.setText(f"Imported {model.name}.")
        self._refresh_local()
        self.model_added.emit(model)
        return model

    # --- results -----------------------------------------------------------------------
    @Slot(object)
    def _on_searched(self, hits: list) -> None:
        for h in hits:
            base = "   base model: continues text" if h.base_model else ""
            item = QListWidgetItem(f"{h.repo_id}   ↓{h.n_downloads}{base}")
            item.setData(Qt.ItemDataRole.UserRole, h.repo_id)
            self.repos.addItem(item)
        self.status.setText(f"{len(hits)} repositories found." if hits
                            else "No GGUF repositories match.")

    @Slot(object)
    def _on_listed(self, details: RepoDetails) -> None:
        current = self.repos.currentItem()
        if current is None or current.data(Qt.ItemDataRole.UserRole) != details.repo_id:
            return  # the user has moved on to another repository
        self.details = details
        self.files.setRowCount(len(details.rows))
        for i, row in enumerate(details.rows):
            choice = row.choice
            cells = (choice.quant, human_bytes(choice.n_bytes), row.fit.label,
                     _draft_text(row.default_draft), choice.name)
            for j, text in enumerate(cells):
                self.files.setItem(i, j, QTableWidgetItem(text))
            self._show_fit(i, row.fit)
            self.files.item(i, DRAFT_COLUMN).setToolTip(_draft_tip(row.default_draft))
        self.files.resizeColumnsToContents()
        self.heads.clear()
        self.heads.addItem("none (drafts from memory)", None)
        for h in details.heads:
            self.heads.addItem(f"{h.repo_id} ({human_bytes(h.n_bytes)}, {h.source})", h)
        if details.heads:
            self.heads.setCurrentIndex(1)
        self.draft_note.setText(_not_offered(details))
        fitting = [i for i, row in enumerate(details.rows) if row.fit.label != TOO_LARGE]
        if fitting:  # preselect the largest quantization that fits: best quality
            self.files.selectRow(fitting[-1])
        self._on_row_selected()
        n_drafts = len({o.label for r in details.rows for o in r.drafts
                        if o.check.compatible})
        self.status.setText(f"{details.repo_id}: {len(details.rows)} models, "
                            f"{len(details.heads)} draft heads, {n_drafts} draft models.")

    @Slot()
    def _on_row_selected(self) -> None:
        """List the selected quantization's compatible drafts, its default first."""
        self.drafts.clear()
        row = self.files.currentRow()
        if self.details is not None and 0 <= row < len(self.details.rows):
            target = self.details.rows[row]
            self.drafts.addItem("none", None)
            for o in target.drafts:
                if o.check.compatible:
                    self.drafts.addItem(_draft_text(o), o)
                    self.drafts.setItemData(self.drafts.count() - 1, _draft_tip(o),
                                            Qt.ItemDataRole.ToolTipRole)
            default = target.default_draft
            self.drafts.setCurrentIndex(next((i for i in range(self.drafts.count())
                                              if default is not None
                                              and self.drafts.itemData(i) == default), 0))
            self._update_fit()
        self._update_buttons()

    @Slot()
    def _update_fit(self) -> None:
        """The selected row's fit with the head and draft chosen now (pure arithmetic)."""
        row = self.files.currentRow()
        if self.details is None or not 0 <= row < len(self.details.rows):
            return
        draft = self.drafts.currentData()
        self._show_fit(row, self.details.fit(self.details.rows[row].choice,
                                             self.heads.currentData(), draft))
        self.files.item(row, DRAFT_COLUMN).setText(_draft_text(draft))
        self.files.item(row, DRAFT_COLUMN).setToolTip(_draft_tip(draft))

    def _show_fit(self, row: int, fit: FitEstimate) -> None:
        assert self.details is not None
        cell = self.files.item(row, FIT_COLUMN)
        cell.setText(fit.label)
        draft = (f", a draft model with its KV cache ({human_bytes(fit.n_draft_bytes)})"
                 if fit.n_draft_bytes else "")
        cell.setToolTip(f"needs {human_bytes(fit.n_total_bytes)}: weights, draft head{draft} "
                        f"and a {self.details.n_ctx}-token KV cache "
                        f"({human_bytes(fit.n_kv_bytes)})")

    @Slot(object)
    def _on_progress(self, p: DownloadProgress) -> None:
        self.progress_bar.setValue(int(1000 * p.n_done / max(p.n_total, 1)))
        phase = {"verify": "checking", "paused": "paused", "retry": "retrying"}.get(p.phase)
        rate = f"{human_bytes(p.bytes_per_s)}/s"
        self.status.setText(f"{p.filename} ({p.index + 1}/{p.n_files}): "
                            f"{human_bytes(p.n_done)} of {human_bytes(p.n_total)}, "
                            f"{phase or rate}")

    @Slot(object)
    def _on_installed(self, model: LocalModel) -> None:
        self.control = None
        self._set_busy(False)
        self.progress_bar.setValue(1000)
        self.status.setText(f"{model.name} is ready.")
        self._refresh_local()
        self.model_added.emit(model)

    @Slot(object)
    def _on_failed(self, failure: HubFailure) -> None:
        if failure.what == "download":
            self.control = None
            self._set_busy(False)
        self.status.setText(("Cancelled: " if failure.cancelled else "Failed: ")
                            + failure.message)

    # --- state -------------------------------------------------------------------------
    def _set_busy(self, busy: bool) -> None:
        self.progress_bar.setRange(0, 1000)
        self.pause_button.setEnabled(busy)
        self.pause_button.setText("Pause")
        self.cancel_button.setEnabled(busy)
        self._update_buttons()

    def _update_buttons(self) -> None:
        ready = (self.details is not None and self.files.currentRow() >= 0
                 and self.control is None)
        self.download_button.setEnabled(ready)

    def _refresh_local(self) -> None:
        self.local.clear()
        for m in self.registry.list():
            head = f", head {m.head_repo}" if m.head_repo else ""
            head += f", draft {m.draft_label}" if m.draft_path else ""
            missing = "" if m.available else "  (file missing)"
            self.local.addItem(f"{m.name}  ({m.quant}, {human_bytes(m.n_bytes)}{head})"
                               f"{missing}")

    @Slot()
    def shutdown(self) -> None:
        """Stop the worker thread; a running download is cancelled and its partial file
        kept for a resume. Idempotent; runs when the dialog closes."""
        if self.control is not None:
            self.control.cancel(keep_partial=True)
        if self.thread_.isRunning():
            self.thread_.quit()
            self.thread_.wait(10_000)


def _draft_text(offer: DraftOffer | None) -> str:
    """A draft in a table cell: name, size (or that it is here) and the check."""
    if offer is None:
        return "none"
    where = "on this machine" if offer.choice is None else human_bytes(offer.n_bytes)
    mark = "vocabulary ✓" if offer.check.confirmed else "vocabulary partly checked"
    return f"{offer.label} ({where}, {mark})"


def _draft_tip(offer: DraftOffer | None) -> str:
    if offer is None:
        return "No draft model pairs with this size (none compatible at most 1/4 of it)."
    return f"{offer.label}: {offer.check.verdict}"


def _not_offered(details: RepoDetails) -> str:
    """The paired drafts left out, and why: a vocabulary that differs; the catalog's
    EAGLE-3 heads, checked against the header; and, read from the file's header before
    any download, whether it drafts with its own MTP block."""
    from engine.planning.drafter_options import mtp_option

    bad = [f"{r.pair.draft_repo} ({r.check.verdict})" for r in details.remote
           if not r.check.compatible]
    from engine.hub.eagle3_catalog import eagle3_summary

    lines = [("Not offered: " + "; ".join(bad)) if bad else "",
             eagle3_summary(list(details.eagle3))]
    if details.facts is not None and details.facts.mtp_layers:
        lines.append(mtp_option(details.facts).line())
    return "\n".join(line for line in lines if line)
