"""The Qt binding keeps Python's reference counts: PySide6 6.12.0 dropped one reference to
True on every ``Signal.emit()`` and to None on slot calls, and the app aborted
("Fatal Python error: none_dealloc") once a long session had lost enough of them
(issue 19). Checked in a child process, since a binding with the bug kills its process."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r'''
import gc, json, os, sys, threading
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QCoreApplication, QObject, QThread, Signal, Slot

app = QCoreApplication([])

class Sender(QObject):
    plain = Signal()
    value = Signal(object)
    pair = Signal(int, str)

class Receiver(QObject):
    @Slot()
    def on_plain(self): pass
    @Slot(object)
    def on_value(self, v): pass
    @Slot(int, str)
    def on_pair(self, i, s): pass

def refs():
    gc.collect()
    return {"None": sys.getrefcount(None), "True": sys.getrefcount(True),
            "False": sys.getrefcount(False)}

s, r = Sender(), Receiver()
s.plain.connect(r.on_plain); s.value.connect(r.on_value); s.pair.connect(r.on_pair)
s.value.connect(lambda v: None)
N = int(sys.argv[1])
before = refs()
for i in range(N):
    s.plain.emit(); s.value.emit(i); s.pair.emit(i, "x")
# Across threads too, as the engine worker talks to the window.
worker = QThread(); r2 = Receiver(); r2.moveToThread(worker); worker.start()
s.value.connect(r2.on_value)
for i in range(N):
    s.value.emit(None)
QThread.msleep(200); worker.quit(); worker.wait()
app.processEvents()
after = refs()
print(json.dumps({k: after[k] - before[k] for k in before}))
'''


def test_signals_and_slots_keep_reference_counts():
    n = 50  # few enough that a binding with the bug still lives to report it
    proc = subprocess.run([sys.executable, "-c", PROBE, str(n)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lost = json.loads(proc.stdout.strip().splitlines()[-1])
    # A correct binding loses nothing; a little slack for objects the run itself holds.
    assert all(delta > -n // 2 for delta in lost.values()), (
        f"the Qt binding dropped references over {n} emits: {lost}")
