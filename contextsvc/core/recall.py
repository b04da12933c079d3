"""Ranking raw-history chunks for SearchHistory (DESIGN §5.6): search terms and BM25.

Terms. Text is NFKC-normalized and case-folded. A token is a run of Unicode word characters
(letters, digits, ``_`` and combining marks, which Python's ``\\w`` alone would split off, e.g. in
Devanagari) that may be joined by ``. / \\ - : @`` into a compound such as a file path, a dotted
name, a version or a time. Each occurrence yields the compound whole, its path segments
(``recall.py``), its words (``rank_chunks``) and their parts (``rank``, ``chunks``; camelCase
``HistoryChunk`` -> ``history``, ``chunk``), so a query finds an identifier by its full spelling
and by any part of it. Runs of Chinese/Japanese characters, written without spaces, also yield
their character bigrams. Stop words (a short English and Russian list) are dropped, both from
documents and queries; a query of stop words only has no terms (the engine rejects it).

Ranking. BM25 from ``rank_bm25`` (term frequency saturation ``k1``, length normalization ``b``)
with one change: the IDF. ``BM25Okapi``'s ``log((N - n + 0.5) / (n + 0.5))`` is zero or negative
for a term in half or more of the chunks, and its floor is a fraction of the *average* IDF, which
is itself negative in a small corpus: in a session with one chunk every score is negative, with
two chunks a term found in only one of them scores 0, so a small session could never be searched.
We use the IDF Lucene uses, ``log(1 + (N - n + 0.5) / (n + 0.5))``, which is positive for every
term that occurs; a chunk's score is then > 0 exactly when it contains a query term. A chunk's
breadcrumbs are searched with its text. Equal scores go to the newest chunk (``last_sequence``).
"""

from __future__ import annotations

import functools
import heapq
import math
import re
import unicodedata
from collections.abc import Iterable, Sequence

from rank_bm25 import BM25Okapi

# The chunk value types are defined with the HistoryStore port; ports.py never imports this module.
from contextsvc.core.history import HistoryChunk, ScoredChunk

__all__ = ["RecallIndex", "document_terms", "query_terms", "rank_chunks", "terms"]

#: BM25 term-frequency saturation and length normalization (the usual values; Lucene: 1.2, 0.75).
BM25_K1 = 1.5
BM25_B = 0.75

# English: articles, pronouns, auxiliaries, prepositions, conjunctions.
_STOP_EN = """
    a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its itself
    just me more most my myself no nor not now of off on once only or other our ours ourselves out
    over own same she should so some such than that the their theirs them themselves then there
    these they this those through to too under until up very was we were what when where which
    while who whom why will with would you your yours yourself yourselves
"""
# Russian: the same classes of function words.
_STOP_RU = """
    а без бы был была были было быть в вам вас весь во вот все всё всех вы где да для до его ее её
    если есть еще ещё же за здесь и из или им их к как ко когда кто ли либо мне мной мы на над не
    него нее неё нет ни них но ну о об однако он она они оно от по под при с со так также такой там
    те тем то того тоже той только том ты у уже хотя чего чей чем что чтобы чье чьё эта эти это этот
    я
"""  # noqa: RUF001  (Cyrillic on purpose)
_STOP_WORDS = frozenset(_STOP_EN.split() + _STOP_RU.split())

_PATH_SEPARATORS = re.compile(r"[/\\]")
_SEPARATORS = re.compile(r"[./\\:@\-]+")
_CJK_RUN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]{2,}")


def _mark_ranges() -> str:
    """A character-class body of every combining mark (categories Mn, Mc, Me)."""
    # Marks live in planes 0-1 and in the variation selectors of plane 14; scanning only those
    # keeps the one-time cost small (the full range takes ~0.1 s).
    spans: list[tuple[int, int]] = []
    for lo, hi in ((0, 0x20000), (0xE0000, 0xE0200)):
        for cp in range(lo, hi):
            if unicodedata.category(chr(cp))[0] == "M":
                if spans and spans[-1][1] == cp - 1:
                    spans[-1] = (spans[-1][0], cp)
                else:
                    spans.append((cp, cp))
    return "".join(f"\\U{a:08x}-\\U{b:08x}" if a != b else f"\\U{a:08x}" for a, b in spans)


@functools.cache
def _patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(compound token, compound without path separators); built on first use."""
    word = rf"[\w{_mark_ranges()}]+"
    return re.compile(rf"{word}(?:[./\\:@\-]+{word})*"), re.compile(rf"{word}(?:[.:@\-]+{word})*")


def _camel_parts(word: str) -> list[str]:
    """``HistoryChunk`` -> History, Chunk; ``HTTPServer`` -> HTTP, Server; ``BM25Okapi`` -> BM25, Okapi."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(word)):
        prev, cur = word[i - 1], word[i]
        if cur.isupper() and (
            prev.islower() or prev.isdigit() or (prev.isupper() and i + 1 < len(word) and word[i + 1].islower())
        ):
            parts.append(word[start:i])
            start = i
    parts.append(word[start:])
    return parts


def _expand(token: str, segment_pattern: re.Pattern[str]) -> list[str]:
    """Every term one token occurrence yields, in its original case (duplicates possible)."""
    out = [token]
    words = [w for w in _SEPARATORS.split(token) if w]
    if len(words) > 1 and _PATH_SEPARATORS.search(token):
        out.extend(s for s in segment_pattern.findall(token) if s not in words)
    if len(words) > 1:
        out.extend(words)
    for word in words:
        pieces = [p for p in word.split("_") if p] if "_" in word else [word]
        if len(pieces) > 1:
            out.extend(pieces)
        for piece in pieces:
            if not piece.islower() and not piece.isupper():  # mixed case (or no cased letters)
                camel = _camel_parts(piece)
                if len(camel) > 1:
                    out.extend(camel)
            for run in _CJK_RUN.findall(piece):
                if len(run) > 2 or run != piece:
                    out.append(run)
                out.extend(run[i : i + 2] for i in range(len(run) - 1))
    return out


def terms(text: str) -> list[str]:
    """The search terms of ``text``, in order, repeated as often as they occur (stop words dropped)."""
    token_pattern, segment_pattern = _patterns()
    out: list[str] = []
    for token in token_pattern.findall(unicodedata.normalize("NFKC", text)):
        seen: set[str] = set()
        for term in _expand(token, segment_pattern):
            folded = term.casefold()
            # One occurrence counts once per term: "a_b" mentions "a" once, not once per level.
            if folded not in seen and folded not in _STOP_WORDS:
                seen.add(folded)
                out.append(folded)
    return out


def query_terms(query: str) -> list[str]:
    """The distinct terms of a query, in order. Empty for a blank or stop-word-only query."""
    return list(dict.fromkeys(terms(query)))


def document_terms(chunk: HistoryChunk) -> list[str]:
    """What a chunk is found by: its text and its breadcrumbs."""
    found = terms(chunk.text)
    for crumb in chunk.breadcrumbs:
        found.extend(terms(crumb))
    return found


class _LuceneIdfBM25(BM25Okapi):  # type: ignore[misc]  # rank_bm25 ships no type hints
    """``BM25Okapi`` with Lucene's always-positive IDF (see the module docstring)."""

    def _calc_idf(self, nd: dict[str, int]) -> None:
        n = self.corpus_size
        self.idf = {word: math.log(1.0 + (n - freq + 0.5) / (freq + 0.5)) for word, freq in nd.items()}


class RecallIndex:
    """The chunks of one session, unique by ``content_hash``, with their terms; the BM25 model
    is built on the first search after a change and reused until the next one."""

    __slots__ = ("_chunks", "_hashes", "_model", "_terms")

    def __init__(self, chunks: Iterable[HistoryChunk] = ()) -> None:
        self._chunks: list[HistoryChunk] = []
        self._hashes: set[str] = set()
        self._terms: list[list[str]] = []
        self._model: _LuceneIdfBM25 | None = None
        self.add(chunks)

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def chunks(self) -> list[HistoryChunk]:
        """Every chunk, in the order added."""
        return list(self._chunks)

    def fresh(self, chunks: Iterable[HistoryChunk]) -> list[HistoryChunk]:
        """The chunks ``add`` would keep: hash not yet indexed, first of its hash in ``chunks``."""
        seen: set[str] = set()
        out: list[HistoryChunk] = []
        for chunk in chunks:
            if chunk.content_hash not in self._hashes and chunk.content_hash not in seen:
                seen.add(chunk.content_hash)
                out.append(chunk)
        return out

    def add(self, chunks: Iterable[HistoryChunk]) -> int:
        """Index the fresh chunks; returns how many there were."""
        new = self.fresh(chunks)
        for chunk in new:
            self._chunks.append(chunk)
            self._hashes.add(chunk.content_hash)
            self._terms.append(document_terms(chunk))
        if new:
            self._model = None
        return len(new)

    def search(self, query: str, limit: int) -> list[ScoredChunk]:
        """Up to ``limit`` chunks with score > 0, best first, ties to the newest ``last_sequence``."""
        wanted = query_terms(query)
        if not wanted or limit <= 0 or not self._chunks:
            return []
        if self._model is None:
            self._model = _LuceneIdfBM25(self._terms, k1=BM25_K1, b=BM25_B)
        model = self._model
        # No query term in any chunk: nothing scores (and an index of stop words only has
        # average length 0, which BM25 would divide by).
        if not any(term in model.idf for term in wanted):
            return []
        scores: list[float] = model.get_scores(wanted).tolist()
        chunks = self._chunks
        best = heapq.nsmallest(
            limit,
            (i for i, score in enumerate(scores) if score > 0),
            key=lambda i: (-scores[i], -chunks[i].last_sequence, -i),
        )
        return [ScoredChunk(chunks[i], float(scores[i])) for i in best]


def rank_chunks(chunks: Sequence[HistoryChunk], query: str, limit: int) -> list[ScoredChunk]:
    """Rank ``chunks`` for ``query`` (duplicates by ``content_hash`` count once); see ``RecallIndex.search``."""
    return RecallIndex(chunks).search(query, limit)
