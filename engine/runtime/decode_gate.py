"""Which native decodes may run at once. llama.cpp's prompt kernels are a process-wide
switch of the CPU library (packaging/llama-cpp/prompt-kernels.patch): while one thread
has them on, a decode on any other context would run with them too and sum in another
order than its exact kernels. For now one lock keeps every decode and every
prompt-kernel section alone in the process. (One context is never decoded by two
threads at once: engine.runtime.native_context also holds a lock per context.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from engine.runtime.llama_bindings import prompt_kernel_switch


class DecodeGate:
    """Decodes (shared holds) and prompt-kernel sections (exclusive holds, which nest,
    and inside which their thread decodes) all one at a time: one reentrant lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # the holder's nested exclusive sections

    def enter_shared(self) -> bool:
        self._lock.acquire()
        return True

    def leave_shared(self, entered: bool = True) -> None:
        if entered:
            self._lock.release()

    def enter_exclusive(self) -> bool:
        """Returns whether this is the thread's outermost section."""
        self._lock.acquire()
        self._depth += 1
        return self._depth == 1

    def leave_exclusive(self) -> bool:
        """Returns whether that was the thread's outermost section."""
        self._depth -= 1
        outermost = self._depth == 0
        self._lock.release()
        return outermost

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """The gate held exclusively; yields whether this is the outermost section."""
        outermost = self.enter_exclusive()
        try:
            yield outermost
        finally:
            self.leave_exclusive()


# The process's gate: every decode of every context passes it (native_context).
DECODE_GATE = DecodeGate()


def prompt_kernels_available() -> bool:
    return prompt_kernel_switch() is not None


@contextlib.contextmanager
def prompt_kernels(on: bool = True) -> Iterator[bool]:
    """llama.cpp's fastest batch kernels for the decodes inside (this thread's; others
    wait): llamafile's sgemm (float, Q8_0, Q5_0, Q4_0 weights) and the tiled K-quant
    matmul (K-quants that are not repacked), for faster prompts (docs/benchmarks.md:
    figures behind the code's rules, "Reading prompts"). A batch of 2+ rows then sums in
    another order than one token, so only a prefill that plain and drafted answers share
    may use them, never a verification. Yields whether they are on."""
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
