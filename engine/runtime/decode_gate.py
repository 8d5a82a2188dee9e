"""Which native decodes may run at once. llama.cpp's prompt kernels are a process-wide
switch of the CPU library (packaging/llama-cpp/prompt-kernels.patch): while one thread
has them on, a decode on any other context would run with them too and sum in another
order than its exact kernels. So a prompt-kernel section runs alone, and every other
decode runs beside the others: a draft model's decode on its context overlaps the
target's verification on its own. (One context is never decoded by two threads at once:
engine.runtime.native_context holds a lock per context inside this gate.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from engine.runtime.llama_bindings import prompt_kernel_switch


class DecodeGate:
    """A readers-writer rule for decodes: shared holders (decodes) run at once; an
    exclusive holder (a prompt-kernel section) runs alone, and may nest sections and
    decode within its own. A waiting exclusive holder stops new shared ones, so a
    stream of draft decodes cannot keep a prompt out.

    Shared holds do not nest: a decode is a native call, which makes no other decode.
    A thread that holds a shared hold never asks for an exclusive one."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # shared holders inside
        self._owner: int | None = None  # the exclusive holder's thread
        self._depth = 0  # its nested sections
        self._exclusive_waiting = 0
        self._shared_waiting = 0

    def enter_shared(self) -> bool:
        """Wait until no other thread holds or waits for the gate exclusively, then hold
        it shared. Returns whether the caller must ``leave_shared``: False inside the
        caller's own exclusive section, which covers its decodes."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                return False
            if self._owner is not None or self._exclusive_waiting:
                self._shared_waiting += 1
                try:
                    while self._owner is not None or self._exclusive_waiting:
                        self._cond.wait()
                finally:
                    self._shared_waiting -= 1
            self._shared += 1
        return True

    def leave_shared(self, entered: bool = True) -> None:
        if not entered:
            return
        with self._cond:
            self._shared -= 1
            if not self._shared and self._exclusive_waiting:
                self._cond.notify_all()

    def enter_exclusive(self) -> bool:
        """Wait until no decode runs and no other thread holds the gate exclusively, then
        hold it so. Returns whether this is the thread's outermost section."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return False
            self._exclusive_waiting += 1
            try:
                while self._owner is not None or self._shared:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._owner, self._depth = me, 1
            return True

    def leave_exclusive(self) -> bool:
        """Returns whether that was the thread's outermost section (the gate is open)."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("leave_exclusive by a thread that does not hold the gate")
            self._depth -= 1
            if self._depth:
                return False
            self._owner = None
            self._cond.notify_all()
            return True

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """The gate held exclusively; yields whether this is the outermost section."""
        outermost = self.enter_exclusive()
        try:
            yield outermost
        finally:
            self.leave_exclusive()

    def waiting(self) -> tuple[int, int]:
        """Threads waiting now: (shared, exclusive)."""
        with self._cond:
            return self._shared_waiting, self._exclusive_waiting

    def holders(self) -> tuple[int, bool]:
        """Holders now: (shared holds, whether a thread holds it exclusively)."""
        with self._cond:
            return self._shared, self._owner is not None


# The process's gate: every decode of every context passes it (native_context).
DECODE_GATE = DecodeGate()


def prompt_kernels_available() -> bool:
    return prompt_kernel_switch() is not None


@contextlib.contextmanager
def prompt_kernels(on: bool = True) -> Iterator[bool]:
    """llama.cpp's fastest batch kernels for the decodes inside (this thread's; every
    other decode waits, and this waits for those running): llamafile's sgemm (float,
    Q8_0, Q5_0, Q4_0 weights) and the tiled K-quant matmul (K-quants that are not
    repacked), for faster prompts (docs/benchmarks.md: figures behind the code's rules,
    "Reading prompts"). A batch of 2+ rows then sums in another order than one token, so
    only a prefill that plain and drafted answers share may use them, never a
    verification. Yields whether they are on."""
    switch = prompt_kernel_switch() if on else None
    if switch is None:
        yield False
        return
    with DECODE_GATE.exclusive() as outermost:
        if outermost:
            switch(True)
        try:
            yield True
        finally:
            if outermost:
                switch(False)
