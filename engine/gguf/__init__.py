"""GGUF files as bytes: headers and shape numbers, vocabulary facts, whether a file can
run at all, llama.cpp's draft compatibility rules, and synthetic files of real model
shapes. Reads and writes with gguf-py and struct; never loads a model in llama.cpp.

May import: ``engine.errors``, ``models``.
"""
