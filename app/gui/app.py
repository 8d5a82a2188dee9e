"""``python -m app.gui``: the desktop window on the bundled default model."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import replace
from pathlib import Path

from PySide6.QtWidgets import QApplication

from app.gui import theme
from app.gui.main_window import MainWindow


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.gui", description=__doc__)
    p.add_argument("--db", type=Path, default=None,
                   help="conversations database (default: in Tandem's data directory)")
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF used in place of the bundled model")
    p.add_argument("--threads", type=int, default=None, help="CPU threads")
    p.add_argument("--send", default=None,
                   help="send this message once the window is open (demos, scripts)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="with --send: the conversation's max tokens")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    theme.follow_system(app)
    app.setApplicationName("Tandem")
    # Ctrl-C in the terminal closes the window cleanly instead of being ignored by Qt.
    signal.signal(signal.SIGINT, lambda *_: app.quit())
    window = MainWindow(args.db, default_model=args.model, n_threads=args.threads)
    window.show()
    if args.send:
        c = window.controller
        if args.max_tokens and c.current_id is not None:
            conv = window.store.conversation(c.current_id)
            window.store.update_conversation(
                conv.id, settings=replace(conv.settings, max_tokens=args.max_tokens))
        c.send(args.send)
    app.aboutToQuit.connect(window.shutdown)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
