"""Where the window opens: inside the screen's available area (the part the task bar and
the menu bar leave), at a size that suits a laptop, centred; and the check that every
visible label and button shows its whole text there."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect, QSize
from PySide6.QtGui import QGuiApplication, QTextDocument
from PySide6.QtGui import Qt as GuiQt
from PySide6.QtWidgets import QAbstractButton, QAbstractScrollArea, QLabel, QWidget

# What the window asks for where the screen has room (logical pixels: HiDPI screens
# scale them): this share of the available area, and at least the smallest size that
# shows the chat, the conversations and one side panel with room to read.
PREFERRED_SHARE = 0.75
PREFERRED_LEAST = QSize(1280, 720)
# The smallest window everything is laid out for: a 1366x768 laptop's available area
# after a task bar and the window's own title bar.
MINIMUM = QSize(960, 600)
# Room for the window manager's frame and title bar, which the geometry excludes.
FRAME_ALLOWANCE = QSize(16, 40)


def initial_geometry(available: QRect) -> QRect:
    """The window's geometry (frame excluded) for a screen whose available area is
    ``available``: the preferred size where it fits, else the area less the frame."""
    room = QSize(max(MINIMUM.width(), available.width() - FRAME_ALLOWANCE.width()),
                 max(MINIMUM.height(), available.height() - FRAME_ALLOWANCE.height()))
    share = QSize(int(available.width() * PREFERRED_SHARE),
                  int(available.height() * (PREFERRED_SHARE + 0.1)))
    size = share.expandedTo(PREFERRED_LEAST).boundedTo(room)
    free = QSize(available.width() - size.width(),
                 available.height() - FRAME_ALLOWANCE.height() - size.height())
    left = available.x() + max(0, free.width()) // 2
    # The title bar sits above the geometry: most of the allowance goes there.
    top = available.y() + FRAME_ALLOWANCE.height() * 3 // 4 + max(0, free.height()) // 2
    return QRect(left, top, size.width(), size.height())


def screen_area() -> QRect:
    """The primary screen's available area (a large default where there is none)."""
    screen = QGuiApplication.primaryScreen()
    return screen.availableGeometry() if screen is not None else QRect(0, 0, 1920, 1080)


def cut_texts(root: QWidget) -> list[str]:
    """The visible labels and buttons under ``root`` whose text does not fit them: a
    one-line label narrower than its text, a wrapped label shorter than its lines, a
    button narrower than it asks to be (Qt clips a button's text). Empty when all fit."""
    found = []
    for widget in root.findChildren(QWidget):
        if not isinstance(widget, QLabel | QAbstractButton) or not widget.text() \
                or not widget.isVisibleTo(root) or widget.width() <= 0:
            continue
        if isinstance(widget, QLabel):
            if not widget.pixmap().isNull():
                continue
            if widget.wordWrap():
                short = widget.heightForWidth(widget.width()) > widget.height() + 2
            else:
                short = _text_width(widget) > widget.contentsRect().width() + 1
            if short:
                found.append(f"label {widget.text()[:60]!r} ({widget.width()}x"
                             f"{widget.height()} px)")
        elif widget.sizeHint().width() > widget.width() + 1:
            found.append(f"button {widget.text()!r} ({widget.width()} px of "
                         f"{widget.sizeHint().width()})")
        if _clipped_sideways(widget):
            found.append(f"{type(widget).__name__} {widget.text()[:60]!r} runs past the "
                         "side of the panel it is in")
    return found


def _clipped_sideways(widget: QWidget) -> bool:
    """Whether a scroll area around ``widget`` shows less than its width (scrolling up
    and down is fine; a row wider than its panel is not)."""
    parent = widget.parentWidget()
    while parent is not None and not isinstance(parent, QAbstractScrollArea):
        parent = parent.parentWidget()
    if parent is None:
        return False
    view = parent.viewport()
    left = widget.mapTo(view, QPoint(0, 0)).x()
    return left < -1 or left + widget.width() > view.width() + 1


def outside(root: QWidget, widgets: list[QWidget]) -> list[str]:
    """Which of ``widgets`` are not wholly inside ``root`` as it is shown."""
    bounds = root.rect()
    return [w.objectName() or type(w).__name__ for w in widgets
            if not w.isVisibleTo(root)
            or not bounds.contains(QRect(w.mapTo(root, QPoint(0, 0)), w.size()))]


def _text_width(label: QLabel) -> int:
    text = label.text()
    if GuiQt.mightBeRichText(text):  # the width of what is drawn, not of the markup
        doc = QTextDocument()
        doc.setDefaultFont(label.font())
        doc.setHtml(text)
        return int(doc.idealWidth()) - 2 * int(doc.documentMargin())
    if label.buddy() is not None:  # "&Model": the ampersand marks the shortcut key
        text = text.replace("&&", "\0").replace("&", "").replace("\0", "&")
    metrics = label.fontMetrics()
    return max(metrics.horizontalAdvance(line) for line in text.splitlines() or [""])
