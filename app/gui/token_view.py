"""The last answer with each token coloured by who produced it."""

from __future__ import annotations

import html

from PySide6.QtWidgets import QLabel, QTextBrowser, QVBoxLayout, QWidget

from app.gui import theme

MAX_TOKENS_SHOWN = 3000


class TokenView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        colors = theme.current()
        legend = QLabel(f'<span style="background:{colors.accepted_draft}">&nbsp;accepted '
                        f'draft&nbsp;</span>&nbsp;&nbsp;<span style="background:'
                        f'{colors.target_token}">&nbsp;target\'s own token&nbsp;</span>')
        self.summary = QLabel("No answer yet.")
        self.summary.setStyleSheet(f"color: {theme.current().muted};")
        self.text = QTextBrowser()
        self.text.setMinimumHeight(100)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(legend)
        layout.addWidget(self.text, 1)
        layout.addWidget(self.summary)

    def set_tokens(self, texts: tuple[str, ...], kinds: tuple[str, ...]) -> None:
        parts = []
        colors = theme.current()
        for text, kind in list(zip(texts, kinds, strict=False))[:MAX_TOKENS_SHOWN]:
            bg = colors.accepted_draft if kind == "draft" else colors.target_token
            parts.append(f'<span style="background:{bg}">{html.escape(text)}</span>')
        self.text.setHtml('<div style="white-space: pre-wrap;">' + "".join(parts) + "</div>")
        n_draft = sum(k == "draft" for k in kinds)
        share = n_draft / len(kinds) if kinds else 0.0
        self.summary.setText(f"{len(kinds)} tokens, {n_draft} from accepted drafts "
                             f"({share:.0%}).")
