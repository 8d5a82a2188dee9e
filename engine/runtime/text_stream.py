"""Turns generated tokens into text deltas: whole UTF-8 characters only, stop strings cut."""

from __future__ import annotations

import codecs


class TextStream:
    """Feed token bytes; get the text that is safe to show.

    Text that could be the start of a stop string is held back until it is known not to
    be one, so a stop string never flashes on screen.
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet released
        self.text = ""  # released so far
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """Add a token's bytes; returns the newly released text."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        for s in self.stop:
            at = self._pending.find(s)
            if at >= 0:
                self._pending = self._pending[:at]
                self.stopped = True
                return self._release(len(self._pending))
        return self._release(len(self._pending) - self._held_back())

    def finish(self) -> str:
        """Release whatever is held (the stream ended without a stop string)."""
        if not self.stopped:
            self._pending += self._decoder.decode(b"", final=True)
        return self._release(len(self._pending))

    def _held_back(self) -> int:
        """Length of the longest pending suffix that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        self.text += out
        return out
