"""Choosing what runs where: calibration (what verifying and drafting cost on this
machine, cached), the planner (layout, drafter and budget from those costs), measured
profiles of big model shapes, and the record of what draft models achieved with a target.

May import: ``engine.decoding``, ``engine.drafters``, ``engine.runtime``, ``engine.gguf``,
``engine.errors``, ``models``.
"""
