"""Tandem's engine: a GGUF target run by llama.cpp, drafts that it verifies, and a plan.

Rooms, from the bottom up; a room imports only from rooms below it (the contracts in
pyproject.toml, checked by ``tests/test_import_rules.py``):

- ``errors``: the typed errors every room raises.
- ``gguf/``: GGUF files as bytes (headers, vocabulary facts, file checks, the draft
  compatibility rules, synthetic files of real shapes). Never runs a model.
- ``runtime/``: llama.cpp at work: native handles (the only module that imports
  ``llama_cpp``), the target and its KV cache, the machine it runs on, what a model file
  holds (``model_info``), chat templates, text streaming.
- ``drafters/`` and ``hub/``, side by side: every drafter and its factory; models on this
  machine and on the Hugging Face Hub (search, download, convert, the bundled model).
- ``decoding/``: the loop that drafts and verifies, acceptance, sampling, the draft budget,
  statistics.
- ``planning/``: what things cost here (calibration), the planner, measured profiles, the
  record of what draft models achieved.
- ``session``: ``Engine``, the one object the app, CLI, bench and API use.

The engine never imports ``app`` or ``training``, nor Qt; ``models`` (the draft heads'
torch modules) sits below it.
"""
