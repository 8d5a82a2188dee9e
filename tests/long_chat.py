"""A long conversation in the real window, offscreen: N turns of up to M new tokens in a
context of C tokens, as a user who never starts a new chat. Not part of ``make test``
(minutes); the issue's target is 100 turns of 64 in 2,048.

    python -m tests.long_chat --turns 100 --max-tokens 64 --ctx 2048
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEventLoop, QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.gui.main_window import MainWindow  # noqa: E402

TOPICS = ("the sea", "a lighthouse", "bread", "rivers", "the moon", "trains", "bees",
          "glass", "maps", "rain")


def _wait(signal, timeout_s: float = 300.0) -> list:  # noqa: ANN001
    loop, got = QEventLoop(), []

    def done(*args: object) -> None:
        got.append(args)
        loop.quit()

    signal.connect(done)
    QTimer.singleShot(int(timeout_s * 1000), loop.quit)
    loop.exec()
    signal.disconnect(done)
    if not got:
        raise TimeoutError("no answer in time")
    return list(got[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--screenshot", type=Path, default=None,
                        help="save the window at the end (the dropped turns' marker shows)")
    args = parser.parse_args()
    app = QApplication.instance() or QApplication([])
    db = Path(tempfile.mkdtemp(prefix="tandem-long-chat-")) / "chat.sqlite3"
    w = MainWindow(db, n_threads=2)
    w.show()
    _wait(w.engine_ready)
    w.load_engine(replace(w.engine_panel.choice(), n_ctx=args.ctx))
    _wait(w.engine_ready)
    w.settings_panel.max_tokens.setValue(args.max_tokens)
    rows, failures = [], []
    w.controller.problem.connect(failures.append)
    t0 = time.perf_counter()
    for turn in range(args.turns):
        text = f"Tell me one more thing about {TOPICS[turn % len(TOPICS)]} (turn {turn + 1})."
        w.chat.composer.setPlainText(text)
        w.chat.submit()
        outcome = _wait(w.controller.answer_finished)[0]
        rows.append({"turn": turn + 1, "finish": outcome.finish_reason,
                     "new_tokens": outcome.stats.n_new, "dropped": outcome.n_dropped,
                     "ttft_s": round(outcome.stats.ttft_s, 3),
                     "reused": outcome.stats.n_prompt_reused})
        app.processEvents()
    messages = w.store.messages(w.controller.current_id)
    statuses = {m.status for m in messages}
    result = {"turns": args.turns, "ctx": args.ctx, "max_tokens": args.max_tokens,
              "seconds": round(time.perf_counter() - t0, 1), "messages": len(messages),
              "statuses": sorted(statuses), "problems": failures,
              "first_drop_at_turn": next((r["turn"] for r in rows if r["dropped"]), None),
              "max_dropped": max(r["dropped"] for r in rows),
              "integrity": w.store.db.execute("PRAGMA integrity_check").fetchone()[0],
              "rows": rows}
    if args.screenshot:  # where the dimmed (left out) messages meet the ones still seen
        dropped = w.transcript.n_out_of_context()
        if dropped:
            from PySide6.QtWidgets import QAbstractItemView

            w.chat.transcript.scrollTo(w.transcript.index(dropped - 1),
                                       QAbstractItemView.ScrollHint.PositionAtCenter)
        app.processEvents()
        w.grab().save(str(args.screenshot))
    w.close()
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
