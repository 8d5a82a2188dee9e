"""llama.cpp at work: native handles (``native`` and the modules it names, with
``native_rpc`` the only ones that import ``llama_cpp``), the target model with the KV
cache Tandem keeps in step, moving KV cells between caches, the draft tree the target
verifies, what a model file holds before its weights load, the machine it all runs on,
chat templates and text streaming.

May import: ``engine.gguf``, ``engine.errors``, ``models``.
"""
