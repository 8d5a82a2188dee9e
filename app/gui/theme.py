"""Light and dark colours, following the system's colour scheme.

Text takes the palette's colours; the window's own surfaces (the chat's background, the
message cards, code, the token view, the plots) take the theme's, so a dark system gets
light text on dark cards, not on the light ones a fixed colour would paint.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette


@dataclass(frozen=True)
class Theme:
    dark: bool
    chat_background: str
    user_card: str
    bot_card: str
    border: str
    accent: str  # a selected card, the version arrows, "generating"
    muted: str  # captions, footers, hints
    dimmed: str  # a version arrow with nowhere to go
    banner: str  # the edit banner's background
    note: str  # the engine panel's notes
    code_background: str
    inline_code_background: str
    accepted_draft: str  # the token view's backgrounds
    target_token: str
    plot_background: str
    plot_foreground: str


LIGHT = Theme(False, "#f6f8fa", "#e7f0fd", "#ffffff", "#d0d7de", "#4a86e8", "#6a737d",
              "#c0c6cc", "#fff4ce", "#9a5b00", "#f1f3f5", "#e9ecef", "#c8efd2", "#fde0c5",
              "#ffffff", "#24292f")
DARK = Theme(True, "#0d1117", "#1b3658", "#161b22", "#30363d", "#58a6ff", "#9aa4ae",
             "#484f58", "#4d3800", "#e3b341", "#1c2128", "#2d333b", "#1f4d2c", "#5a3514",
             "#0d1117", "#c9d1d9")


def system_is_dark() -> bool:
    """The system's colour scheme (Qt 6.5+ reads it from the desktop), else whether the
    palette's window colour is dark."""
    app = QGuiApplication.instance()
    if app is None:
        return False
    scheme = app.styleHints().colorScheme()
    if scheme == Qt.ColorScheme.Dark:
        return True
    if scheme == Qt.ColorScheme.Light:
        return False
    return app.palette().color(QPalette.ColorRole.Window).lightness() < 128


def current() -> Theme:
    return DARK if system_is_dark() else LIGHT


def color(name: str) -> QColor:
    """A colour of the current theme, by field name."""
    return QColor(getattr(current(), name))


def follow_system(app: QGuiApplication) -> Theme:
    """Give a dark system a dark palette where the platform did not (a style that keeps
    its light palette would put the palette's dark text on the theme's dark cards)."""
    theme = current()
    window = app.palette().color(QPalette.ColorRole.Window)
    if theme.dark and window.lightness() >= 128:
        app.setPalette(dark_palette())
    return theme


def dark_palette() -> QPalette:
    p = QPalette()
    roles = QPalette.ColorRole
    for role, value in ((roles.Window, "#161b22"), (roles.WindowText, "#c9d1d9"),
                        (roles.Base, "#0d1117"), (roles.AlternateBase, "#161b22"),
                        (roles.Text, "#c9d1d9"), (roles.Button, "#21262d"),
                        (roles.ButtonText, "#c9d1d9"), (roles.Highlight, "#1f6feb"),
                        (roles.HighlightedText, "#ffffff"), (roles.ToolTipBase, "#161b22"),
                        (roles.ToolTipText, "#c9d1d9"), (roles.PlaceholderText, "#8b949e"),
                        (roles.Link, "#58a6ff"), (roles.BrightText, "#ffffff")):
        p.setColor(role, QColor(value))
    p.setColor(QPalette.ColorGroup.Disabled, roles.Text, QColor("#6e7681"))
    p.setColor(QPalette.ColorGroup.Disabled, roles.ButtonText, QColor("#6e7681"))
    return p
