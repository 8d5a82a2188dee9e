"""The decoding loop: one ``generate`` for plain and speculative decoding, which drafted
tokens the target keeps, sampling maths, how much to draft per step, and the statistics
every screen shows.

May import: ``engine.drafters``, ``engine.runtime``, ``engine.gguf``, ``engine.errors``.
"""
