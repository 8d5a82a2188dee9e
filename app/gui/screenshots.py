"""Screenshots of the real window on the real model, for reviewing the UI.

    xvfb-run -a .venv/bin/python -m app.gui.screenshots --out shots/
    QT_QPA_PLATFORM=offscreen .venv/bin/python -m app.gui.screenshots --out shots/

Writes chat.png (the whole window after an answer with code), branches.png (the answer
regenerated: "‹ 2/2 ›" switches between its versions), streaming.png (mid-answer),
dashboard.png and dashboard_full.png (after a comparison with plain decoding) and
interrupted.png (an answer left by a killed app, as the next start shows it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QEventLoop, QTimer, SignalInstance
from PySide6.QtWidgets import QApplication

from app.conversation_store import STREAMING, ConversationStore
from app.gui.main_window import MainWindow

PROMPT_CODE = ("Explain what a Python list comprehension is, with a short code example "
               "in a code block.")
PROMPT_LONG = "Write a long story about a lighthouse keeper and a storm."


def _wait(signal: SignalInstance | None = None, until: Callable[[], bool] | None = None,
          timeout_ms: int = 180_000) -> None:
    """Run the event loop until ``signal`` fires or ``until()`` holds."""
    loop = QEventLoop()
    if signal is not None:
        signal.connect(loop.quit)
    poll = QTimer()
    if until is not None:
        poll.timeout.connect(lambda: until() and loop.quit())
        poll.start(20)
    QTimer.singleShot(timeout_ms, loop.quit)
    loop.exec()
    poll.stop()
    if signal is not None:
        signal.disconnect(loop.quit)


def _settle(ms: int = 400) -> None:
    _wait(until=None, timeout_ms=ms)


def take_screenshots(out: Path, model: Path | None, db_dir: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    db = db_dir / "screens.sqlite3"
    w = MainWindow(db, default_model=model)
    w.resize(1500, 920)
    w.show()
    _wait(w.engine_ready)
    w.settings_panel.max_tokens.setValue(160)
    w.controller.send(PROMPT_CODE)
    _wait(w.controller.answer_finished)
    _settle()
    written = [out / "chat.png"]
    w.grab().save(str(written[-1]))
    w.controller.regenerate()
    _wait(w.controller.answer_finished)
    _settle()
    written.append(out / "branches.png")
    w.grab().save(str(written[-1]))

    w.controller.compare()
    _wait(w.controller.comparison_finished)
    _settle()
    written.append(out / "dashboard.png")
    w.dashboard_dock.grab().save(str(written[-1]))
    written.append(out / "dashboard_full.png")  # the whole scrolled panel
    w.dashboard.widget().grab().save(str(written[-1]))

    w.controller.new_conversation()
    w.settings_panel.max_tokens.setValue(400)
    w.controller.send(PROMPT_LONG)
    _wait(until=lambda: len(w.transcript.messages[-1].content) > 300)
    _settle(300)
    written.append(out / "streaming.png")
    w.grab().save(str(written[-1]))
    # Leave this answer mid-stream in the database, as a killed app would.
    active = w.controller.active
    w.controller.stop()
    _wait(w.controller.answer_finished)
    if active is not None and active.message is not None:
        w.store.update_message(active.message.id, active.content[:400], STREAMING, {})
    w.shutdown()
    w.deleteLater()

    with ConversationStore(db):  # the next start: recovery marks it interrupted
        pass
    w2 = MainWindow(db, default_model=model)
    w2.resize(1500, 920)
    w2.show()
    _wait(w2.engine_ready)
    _settle()
    written.append(out / "interrupted.png")
    w2.grab().save(str(written[-1]))
    w2.shutdown()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.gui.screenshots", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: bundled)")
    args = p.parse_args(argv)
    from app.gui import theme

    app = QApplication.instance() or QApplication(sys.argv[:1])
    theme.follow_system(app)
    with tempfile.TemporaryDirectory() as tmp:
        for path in take_screenshots(args.out, args.model, Path(tmp)):
            print(path)
    del app
    return 0


if __name__ == "__main__":
    sys.exit(main())
