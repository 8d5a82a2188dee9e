"""A user's question as an SQLite FTS5 MATCH expression that cannot fail to parse.

FTS5 reads quotes, parentheses, ``AND``/``OR``/``NOT``/``NEAR``, ``*``, ``^`` and ``:``
as syntax; a question holds any of them. So only the question's words are kept, each
quoted as a phrase (FTS5 runs the phrase through the table's tokenizer, so case and
diacritics match as in the index), and they are ORed: BM25 ranks chunks holding more
and rarer words first.
"""

from __future__ import annotations

import re

MAX_TERMS = 32  # a pasted paragraph as the question stays a cheap query

# Words that match nearly every chunk and only blur the ranking.
_STOP_WORDS = """
a about above after again against all also am an and any are as at be because been
before being below between both but by can could did do does doing down during each
few for from further had has have having he her here hers herself him himself his how
i if in into is it its itself just me more most my myself no nor not now of off on
once only or other our ours ourselves out over own same she should so some such than
that the their theirs them themselves then there these they this those through to too
under until up very was we were what when where which while who whom why will with
would you your yours yourself yourselves please
"""
STOP_WORDS = frozenset(_STOP_WORDS.split())

_WORD = re.compile(r"\w+")


def search_terms(query: str) -> list[str]:
    """The query's searchable words: lower case, first occurrence order, no stop words,
    none of one character."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(query.casefold()):
        word = word.strip("_")
        if len(word) > 1 and word not in STOP_WORDS:
            seen.setdefault(word, None)
    return list(seen)[:MAX_TERMS]


def match_expression(query: str) -> str | None:
    """``"w1" OR "w2" ...`` for FTS5 MATCH, or None when the query has no usable word."""
    terms = search_terms(query)
    if not terms:
        return None
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)
