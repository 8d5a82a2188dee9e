"""Documents in a conversation: files a user attaches to a message, read into text.

``reading`` turns a file (text, Markdown, code, PDF, DOCX, HTML) into a ``Document`` or
a ``DocumentError`` whose message a user can act on (PDF, DOCX and HTML are parsed by
``parsers`` in a child process, ``reader_child``, that ``reader_process`` bounds in memory
and time and can kill); ``chunks`` cuts a document into passages for search;
``context`` decides what of the attached documents the model reads with a question (all
of them when they fit, else the passages that match). Storage and
search live in ``app.conversation_store``. No Qt here: the GUI calls in from a worker.
"""
