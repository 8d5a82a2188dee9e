"""The window at a laptop's screen size, looked at: screenshots of the first start, a
chat, the dashboard and the settings open, and every label or button whose text does not
fit (app.gui.window_fit.cut_texts). Exits 1 when one does, or when the window leaves the
screen.

    .venv/bin/python -m app.gui.laptop_shots --screen 1366x768 --out docs/images/

Runs offscreen on a screen of that size (or on the real display with ``--display``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def _offscreen(width: int, height: int, folder: Path) -> None:
    config = folder / "screen.json"
    config.write_text(json.dumps({"screens": [{
        "name": "laptop", "x": 0, "y": 0, "width": width, "height": height,
        "logicalDpi": 96, "logicalBaseDpi": 96, "dpr": 1}]}))
    os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={config}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.gui.laptop_shots", description=__doc__)
    p.add_argument("--screen", default="1366x768", help="WIDTHxHEIGHT of the screen")
    p.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: bundled)")
    p.add_argument("--display", action="store_true",
                   help="use the real display (Xvfb) instead of an offscreen screen")
    p.add_argument("--dark", action="store_true",
                   help="as on a system in dark mode (the file names end in -dark)")
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.screen.lower().split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        if not args.display:
            _offscreen(width, height, Path(tmp))
        return _shoot(args.out, args.model, Path(tmp),
                      f"{width}x{height}" + ("-dark" if args.dark else ""), args.dark)


def _shoot(out: Path, model: Path | None, folder: Path, tag: str, dark: bool = False) -> int:
    from PySide6.QtWidgets import QApplication

    from app.gui import theme
    from app.gui.main_window import MainWindow
    from app.gui.screenshots import _settle, _wait
    from app.gui.transcript_model import SOURCES_ROLE
    from app.gui.window_fit import cut_texts, outside

    app = QApplication.instance() or QApplication(sys.argv[:1])
    if dark:
        app.setPalette(theme.dark_palette())
    theme.follow_system(app)
    out.mkdir(parents=True, exist_ok=True)
    w = MainWindow(folder / "chat.sqlite3", default_model=model)
    w.show()
    _wait(w.engine_ready)
    _settle()
    problems: list[str] = []

    def look(name: str) -> None:
        _settle(300)
        screen = app.primaryScreen().availableGeometry()
        if not screen.contains(w.frameGeometry()):
            problems.append(f"{name}: the window {w.frameGeometry().getRect()} leaves the "
                            f"screen {screen.getRect()}")
        problems.extend(f"{name}: {p}" for p in cut_texts(w))
        problems.extend(f"{name}: {p} not in the window"
                        for p in outside(w, [w.chat.composer, w.chat.send_button]))
        path = out / f"{name}-{tag}.png"
        w.grab().save(str(path))
        print(path)

    look("first-start")
    w.settings_panel.max_tokens.setValue(120)
    w.controller.send("Explain what a Python list comprehension is, with a short example.")
    _wait(w.controller.answer_finished)
    look("chat")
    w.dashboard_toggle.setChecked(True)
    w.dashboard.details_button.setChecked(True)
    look("dashboard")
    w.dashboard_toggle.setChecked(False)
    w.settings_toggle.setChecked(True)
    look("settings")
    w.settings_toggle.setChecked(False)
    _attach_and_ask(w, folder, _wait)
    look("documents")
    dialog = w.chat.show_sources(w.transcript.index(len(w.transcript.messages) - 1)
                                 .data(SOURCES_ROLE))
    _settle(300)
    path = out / f"sources-{tag}.png"
    dialog.grab().save(str(path))
    print(path)
    problems.extend(f"sources: {p}" for p in cut_texts(dialog))
    dialog.close()
    _tool_servers(w, folder, _wait)
    w.settings_toggle.setChecked(True)
    w.settings_drawer.ensureWidgetVisible(w.tools_panel)
    look("tools-settings")
    w.settings_toggle.setChecked(False)
    w.controller.new_conversation()
    w.settings_panel.tools_required.setChecked(True)
    w.settings_panel.tool_rounds.setValue(1)
    w.settings_panel.max_tokens.setValue(60)
    w.controller.send("What does the lighthouse note say about the keeper's duties?")
    _wait(until=lambda: w.chat.approval.isVisible()
          and w.chat.approval.allow_button.isEnabled(), timeout_ms=120_000)
    look("tool-approval")
    w.chat.approval.allow_button.click()
    _wait(until=lambda: not w.controller.busy, timeout_ms=120_000)
    look("tool-answer")
    w.shutdown()
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


def _tool_servers(w, folder: Path, wait) -> None:  # noqa: ANN001
    """The files server over a folder of notes imported from an mcp.json, started as a
    user would: the review shows it, Start."""
    from app.benchmarks.tool_loop import make_tool_folder

    files = make_tool_folder(folder / "harbour-files")
    config = folder / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"harbour-files": {
        "command": sys.executable, "args": ["-m", "app.tools.files_server", str(files)]}}}))
    w.tools_panel.import_file(config)
    w.tools_panel.review_dialog.start_button.click()
    wait(until=lambda: w.tool_servers.status("harbour-files").state == "running",
         timeout_ms=60_000)


def _attach_and_ask(w, folder: Path, wait) -> None:  # noqa: ANN001
    """A chat with a 20-page PDF attached (too long to go whole: its passages go in), a
    question about its page 13 answered."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=11)
    topics = ["the opening hours", "the ferry timetable", "the harbour master", "the fees"]
    for i in range(1, 21):
        topic = topics[i % len(topics)]
        pdf.add_page()
        pdf.multi_cell(0, 6, f"Page {i} of the Port Ellery guide covers {topic}. " + " ".join(
            f"Line {k}: the harbour keeps its ledger of boats, nets and ropes." for k in
            range(30)) + (" The harbour master is Orlando Vance, on duty from six." if i == 13
                          else ""))
    guide = folder / "port-ellery-guide.pdf"
    pdf.output(str(guide))
    w.controller.new_conversation()
    w.controller.attach_files([guide])
    wait(until=lambda: w.chat.attachments.n_documents == 1, timeout_ms=60_000)
    w.controller.send("Who is the harbour master, and when is he on duty?")
    wait(w.controller.answer_finished)


if __name__ == "__main__":
    sys.exit(main())
