"""The positions a sliding-window model's window cache lacks after a long prompt's cells
moved in from the F16 context: one sequence's state brings the window cache only the
last window of the moved cells (llama.cpp leaves out cells outside the window), so cells
kept from before the move and the moved window have a hole between them, which the
window cache's lowest position cannot show. ``CachedSequence`` keeps one, merged across
moves; a prompt going on from inside it has the window before it moved again
(``CachedSequence.fill_window``) or is read from the hole's start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WindowGap:
    span: tuple[int, int] | None = None  # positions [a, b) missing, None: no hole

    def moved(self, start: int, window_start: int) -> None:
        """Cells from ``start`` on moved in; the window cache got them from
        ``window_start`` on."""
        if window_start > start:
            a, b = self.span or (start, window_start)
            self.span = (min(a, start), max(b, window_start))

    def cut(self, n_keep: int) -> None:
        """The sequence was cut to ``n_keep`` tokens."""
        if self.span is not None and n_keep <= self.span[0]:
            self.span = None

    def refilled_from(self, lo: int) -> None:
        """The window cache got every position from ``lo`` on again."""
        if self.span is not None:
            self.span = (self.span[0], lo) if lo > self.span[0] else None

    def shifted(self, n_same: int, n_cut: int, n_kept: int) -> None:
        """``n_cut`` positions after the first ``n_same`` were cut out and the rest moved
        back over them (a context shift), ``n_kept`` positions in all remaining: the
        hole moved with its cells, or was cut out."""
        if self.span is None:
            return

        def after(p: int) -> int:
            return p if p <= n_same else max(n_same, p - n_cut)

        a, b = after(self.span[0]), after(self.span[1])
        self.span = (a, b) if a < min(b, n_kept) else None
