"""Other machines' memory and compute for the target, through llama.cpp's RPC backend.

- ``endpoints``: parsing HOST:PORT and the bind policy (loopback unless asked);
- ``handshake``: a worker's version and memory asked from Python, before llama.cpp
  connects (llama.cpp aborts the process on a failed connect or handshake);
- ``serve``: ``tandem worker``, this machine's devices served to others;
- ``engine.session_process`` (above the session, as it runs one): an engine whose target
  uses workers runs in a child process, so a worker that dies takes that process, not
  the app.
"""
