"""The model hub: search the Hugging Face Hub for GGUF models, estimate the fit on this
machine, download target and draft head as one resumable job into the huggingface_hub
cache layout, keep the list of local models, convert between weight types, and prepare
the bundled default model. No Qt here; the wizard and the CLI sit on top of these
functions.

May import: ``engine.runtime``, ``engine.gguf``, ``engine.errors``, ``models``.
"""
