"""A paper clip drawn with a path: the attach button's icon and the documents' chips.
Drawn rather than the 📎 emoji, which many Linux desktops lack a font for."""

from __future__ import annotations

from functools import lru_cache

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPainterPath, QPen, QPixmap

SCALE = 2  # drawn at twice its size: sharp on high-density screens


def _arc(path: QPainterPath, cx: float, cy: float, r: float, start: float) -> None:
    """A half turn, clockwise on screen, from the angle ``start`` (0: right, 180: left)."""
    path.arcTo(QRectF(cx - r, cy - r, 2 * r, 2 * r), start, -180)


def paper_clip_path() -> QPainterPath:
    """The clip in a 16 x 16 box: three nested bends, as a clip is bent from wire."""
    path = QPainterPath()
    path.moveTo(9.5, 5.5)
    path.lineTo(9.5, 11.5)
    _arc(path, 7.75, 11.5, 1.75, 0)  # inner bottom bend, right to left
    path.lineTo(6, 3.5)
    _arc(path, 8.75, 3.5, 2.75, 180)  # top bend, left to right
    path.lineTo(11.5, 12)
    _arc(path, 7.75, 12, 3.75, 0)  # outer bottom bend, right to left
    path.lineTo(4, 6)
    return path


def paper_clip_pixmap(color: QColor, size: int = 16) -> QPixmap:
    """Cached per colour and size: the transcript paints it with every chip."""
    return _pixmap(color.name(), size)


@lru_cache(maxsize=16)
def _pixmap(color: str, size: int) -> QPixmap:
    pixmap = QPixmap(size * SCALE, size * SCALE)
    pixmap.setDevicePixelRatio(SCALE)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.scale(size / 16, size / 16)
    pen = QPen(QColor(color), 1.4)
    pen.setCapStyle(Qt.PenCapStyle.RoundCap)
    painter.setPen(pen)
    painter.drawPath(paper_clip_path())
    painter.end()
    return pixmap


def paper_clip_icon(color: QColor) -> QIcon:
    return QIcon(paper_clip_pixmap(color))
