"""Tandem's desktop window (PySide6). Nothing in ``engine/`` imports this package."""
