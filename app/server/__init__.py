"""The local OpenAI-compatible API (`tandem serve`)."""
