"""Ranking raw-history chunks for SearchHistory (DESIGN §5.6): search terms and BM25.

Terms. Text is NFKC-normalized and case-folded. A token is a run of Unicode word characters
(letters, digits, ``_`` and combining marks, which Python's ``\\w`` alone would split off, e.g. in
Devanagari) that may be joined by ``. / \\ - : @`` into a compound such as a file path, a dotted
name, a version or a time. Each occurrence yields the compound whole, its segments between
``/ \\ : @`` (``recall.py`` of a path, ``handler.py`` of ``handler.py:142``, ``example.com`` of an
e-mail address), its words (``rank_chunks``) and their parts (``rank``, ``chunks``; camelCase
``HistoryChunk`` -> ``history``, ``chunk``), so a query finds an identifier by its full spelling
and by any part of it.

Stemming. A term made of letters only is reduced to its Snowball stem (English for ASCII words,
Russian for Cyrillic ones; ``snowballstemmer``), so "databases" finds "database" and "comes"
finds "come". Anything else (a compound, a word with digits or ``_``) is kept exactly as written:
an identifier is never stemmed, and its whole spelling is a term of its own.

Runs of Chinese/Japanese characters, written without spaces, also yield their character bigrams.
Stop words (a short English and Russian list) are dropped, both from documents and queries; a
query of stop words only has no terms (the engine rejects it).

Ranking. BM25 as ``rank_bm25``'s ``BM25Okapi`` scores it (term frequency saturation ``k1``, length
normalization ``b``), kept incrementally by ``RecallIndex`` (the same arithmetic, see there), with
one change: the IDF. ``BM25Okapi``'s ``log((N - n + 0.5) / (n + 0.5))`` is zero or negative
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
import itertools
import math
import re
import threading
import unicodedata
from array import array
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

# The chunk value types are defined with the HistoryStore port; ports.py never imports this module.
from contextsvc.core.facts import anchor_kinds
from contextsvc.core.history import HistoryChunk, ScoredChunk
from contextsvc.core.lazy_re import DIGIT, lazy, may_match

__all__ = [
    "RecallIndex",
    "document_terms",
    "query_terms",
    "rank_chunks",
    "term_coverage",
    "terms",
    "weighted_query_terms",
]

#: BM25 term-frequency saturation and length normalization (the usual values; Lucene: 1.2, 0.75).
BM25_K1 = 1.5
BM25_B = 0.75
#: how many times an identifier term of a query counts (see "Exact identifiers first").
IDENTIFIER_WEIGHT = 2
#: version of the terms this module makes; stores that keep terms re-derive older ones.
TERMS_VERSION = 2
#: A search adds its terms' BM25 parts to the chunks' sums with numpy when its terms hold at least
#: this many postings each on average. numpy's cost is mostly fixed (~10 µs a search, under 1 µs a
#: term), the Python loop's ~60 ns a posting: on held-out text of 5 to 160 chunks the two cost the
#: same at ~4 postings a term, numpy 1.6-2.0x faster at ~50 (a session's common words).
_VECTOR_MIN_POSTINGS = 8

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

_OUTER_SEPARATORS = lazy(r"[/\\:@]")
_SEPARATORS = lazy(r"[./\\:@\-]+")
_CJK_RUN = lazy(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]{2,}")


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
    """(compound token, compound joined by ``.`` and ``-`` only); built on first use."""
    word = rf"[\w{_mark_ranges()}]+"
    return re.compile(rf"{word}(?:[./\\:@\-]+{word})*"), re.compile(rf"{word}(?:[.\-]+{word})*")


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
    if token.isascii() and token.isalnum() and (token.islower() or token.isupper() or token.isdigit()):
        # Most tokens of prose: no separator, no "_", no case change inside, no CJK run (the
        # rules would give back the token alone), at a fifth of their cost.
        return [token]
    return _expand_rules(token, segment_pattern)


def _expand_rules(token: str, segment_pattern: re.Pattern[str]) -> list[str]:
    """``_expand`` by its rules, for any token."""
    out = [token]
    words = [w for w in _SEPARATORS.split(token) if w]
    if len(words) > 1 and _OUTER_SEPARATORS.search(token):
        known = set(words)  # a list's ``in`` made this quadratic in a long token's words
        out.extend(s for s in segment_pattern.findall(token) if s not in known)
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


_ASCII_WORD = lazy(r"[a-z]+")
_CYRILLIC_WORD = lazy(r"[\u0400-\u04ff]+")


@functools.cache
def _stemmers() -> dict[str, Any]:
    """The Snowball stemmers, made on first use: the package imports all its 30+ languages
    (~0.1 s), which server start-up need not pay."""
    import snowballstemmer

    return {"english": snowballstemmer.stemmer("english"), "russian": snowballstemmer.stemmer("russian")}


#: A Snowball stemmer keeps the word it works on in the instance: two threads stemming at once
#: (a history indexed in a worker thread while the event loop reads a query) would mix words.
_STEM_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1 << 16)
def stem(word: str) -> str:
    """The Snowball stem of a case-folded word of letters (English or Russian); other words as they are."""
    if len(word) <= 3:
        return word
    if _ASCII_WORD.fullmatch(word):
        language = "english"
    elif _CYRILLIC_WORD.fullmatch(word):
        language = "russian"
    else:
        return word
    stemmer = _stemmers()[language]
    with _STEM_LOCK:
        return str(stemmer.stemWord(word)) or word


def terms(text: str) -> list[str]:
    """The search terms of ``text``, in order, repeated as often as they occur (stop words dropped)."""
    tokens = _patterns()[0].findall(unicodedata.normalize("NFKC", text))
    return list(itertools.chain.from_iterable(map(_token_terms, tokens)))


#: A token's terms depend on the token alone, and a history repeats its words: a chunk's ~170
#: tokens were ~1 µs each of Python (expand, fold, stop words, stem), a cache hit is a lookup.
@functools.lru_cache(maxsize=1 << 15)
def _token_terms(token: str) -> tuple[str, ...]:
    """The terms of one token occurrence, in order, each once."""
    out: list[str] = []
    for term in _expand(token, _patterns()[1]):
        folded = term.casefold()
        if folded in _STOP_WORDS:
            continue
        out.append(stem(folded) if folded.isalpha() else folded)
    # One occurrence counts once per term: "a_b" mentions "a" once, not once per level.
    return tuple(dict.fromkeys(out))


#: words a chunk gains per kind of anchor it holds (see "Kinds of facts").
_KIND_WORDS = {
    "url": "url link",
    "path": "path file",
    "file_line": "file line",
    "host": "host hostname",
    "ip": "ip address",
    "email": "email address",
    "date": "date",
    "quantity": "",
    "id": "id identifier",
    "name": "person name",
}
#: question words that ask for a kind of fact (they are stop words otherwise).
_ASKS = {"who": "person", "whom": "person", "кто": "person", "кого": "person", "when": "date", "когда": "date"}
_ASK_WORD = lazy(r"\w+")
#: the header of each message in a chunk (``core/chunking.py``): ``#12 user:``, ``#13 tool c3:``.
_HEADER = lazy(r"(?m)^#\d+ (?:user|assistant|system|tool [^\s:]*):")


@functools.lru_cache(maxsize=64)
def _words_of(text: str) -> tuple[str, ...]:
    return tuple(terms(text))


#: cloud regions (``eu-west-1``, ``us-east-2``, ``ap-southeast-1``): a kind of their own.
_REGION = lazy(
    r"\b(?:us|eu|ap|sa|ca|me|af|il|mx)-(?:gov-)?(?:north|south|east|west|central|(?:north|south)(?:east|west))-\d\b",
    re.I,
)


#: an issue-tracker key (``INC-4411``, ``CHG-20931``): a ticket.
_TICKET = lazy(r"\b[A-Z][A-Z0-9]{1,9}-\d{2,}\b")
#: what makes an id an id for search: letters and digits mixed (``acct_9f3k2x``, ``b7e4c1d9a2``)
#: in a token of 5+ characters. A snake_case or camelCase name alone (``run_command``) is code, not
#: an id someone asks for: facts.py keeps it as an anchor, search does not call it an "id".
#: (Starting where a run of ``[\w-]`` starts: the two look-aheads re-read the run from every character.)
_ID_TOKEN = lazy(r"(?<![\w-])-*+\b(?=[\w-]*[a-z])(?=[\w-]*\d)[\w-]{5,}\b", re.I)


#: What ``_REGION``, ``_TICKET`` and ``_ID_TOKEN`` cannot match without (``lazy_re.may_match``):
#: each scans every word of a chunk (~40, ~15 and ~50 µs a KB of prose) for what most chunks lack.
#: The region gate is the pattern's own middle, which starts with a literal (a fast scan).
_REGION_NEEDS = (lazy(r"-(?:gov-)?(?:north|south|east|west|central|(?:north|south)(?:east|west))-\d", re.I),)
_TICKET_NEEDS = (lazy(r"-\d\d"),)
_ID_TOKEN_NEEDS = (DIGIT,)


def kind_terms(text: str) -> list[str]:
    """The kind words of the anchors ``text`` holds, once each."""
    kinds = anchor_kinds(text)
    if "id" in kinds and not (may_match(text, _ID_TOKEN_NEEDS) and _ID_TOKEN.search(text)):
        kinds.discard("id")
    out: list[str] = []
    for kind in sorted(kinds):
        out.extend(_words_of(_KIND_WORDS[kind]))
    if may_match(text, _REGION_NEEDS) and _REGION.search(text):
        out.extend(_words_of("region"))
    if may_match(text, _TICKET_NEEDS) and _TICKET.search(text):
        out.extend(_words_of("ticket issue"))
    return list(dict.fromkeys(out))


def query_terms(query: str) -> list[str]:
    """The distinct terms of a query, in order, plus the kind a "who"/"when" asks for (when the
    query has other terms). Empty for a blank or stop-word-only query."""
    return list(_query_terms(query))


@functools.lru_cache(maxsize=64)
def _query_terms(query: str) -> tuple[str, ...]:
    # Kept for the few latest queries: a build with recall asks for its message's terms twice (the
    # engine's choice of excerpts, the store's search).
    found = terms(query)
    if found:  # "who" alone asks for nothing in particular
        for word in _ASK_WORD.findall(query.casefold()):
            if word in _ASKS:
                found.extend(_words_of(_ASKS[word]))
    return tuple(dict.fromkeys(found))


def is_identifier(term: str) -> bool:
    """A term that is not an ordinary word: it holds a digit, ``_`` or a separator (``acct_9f3k2x``,
    ``10.0.3.7``, ``inc-4411``, ``2026-03-14``); a bare number of one or two digits is not."""
    return not term.isalpha() and (len(term) >= 3 or not term.isdigit())


def weighted_query_terms(query: str) -> list[str]:
    """``query_terms`` with every identifier repeated ``IDENTIFIER_WEIGHT`` times: what BM25 scores."""
    return [t for t in query_terms(query) for _ in range(IDENTIFIER_WEIGHT if is_identifier(t) else 1)]


def term_coverage(wanted: Sequence[str], chunk: HistoryChunk, terms: Collection[str] | None = None) -> float:
    """The share (0-1) of the distinct query terms ``wanted`` that ``chunk`` contains; ``terms``:
    the chunk's search terms when known (``ScoredChunk.terms``). Finding them again cost recall
    ~0.4 ms a 2 KB chunk, for each of the best chunks of every build with an incoming message."""
    distinct = set(wanted)
    if not distinct:
        return 0.0
    held = terms if terms is not None else set(document_terms(chunk))
    return sum(1 for term in distinct if term in held) / len(distinct)


def document_terms(chunk: HistoryChunk) -> list[str]:
    """What a chunk is found by: its text (without the ``#12 tool c3:`` headers of its messages,
    bookkeeping a question never means), its breadcrumbs and the kinds of anchors in its text."""
    text = _HEADER.sub(" ", chunk.text)
    found = terms(text)
    for crumb in chunk.breadcrumbs:
        found.extend(terms(crumb))
    found.extend(kind_terms(text))
    return found


@functools.cache
def _numpy() -> Any:
    """numpy, imported by the first search that sums with it: a start of the server never needs it."""
    import numpy

    return numpy


def bm25_idf(n: int, df: int) -> float:
    """Lucene's always-positive IDF of a term found in ``df`` of ``n`` chunks (module docstring)."""
    return math.log(1.0 + (n - df + 0.5) / (df + 0.5))


class RecallIndex:
    """The chunks of one session, unique by ``content_hash``, with BM25's statistics kept up to
    date as chunks are added: each chunk's term frequencies and length, the total length, and per
    term its document frequency and the chunks that hold it (postings).

    A search therefore costs the postings of its terms, not the whole history: rebuilding a
    ``rank_bm25`` model over every chunk after each compaction's ``add`` made every build with
    recall O(history), and a 1,000-turn session quadratic. Scores are those of ``rank_bm25``'s
    ``BM25Okapi`` with the Lucene IDF, bit for bit (the same operations in the same order: per
    query term, in the query's order, ``idf x tf (k1 + 1) / (tf + k1 (1 - b + b dl / avgdl))``
    added to the chunk's sum); ``tests/unit/test_recall_incremental.py`` compares them with a
    model built fresh.

    A chunk's terms are found when a search first needs them, not when it is added: finding them
    is most of the index's cost (~5 MB of text a second), every compaction adds chunks, and a
    session whose views are built without an incoming message (``RecallSettings``) may never be
    searched. Chunks are indexed in the order added, so the statistics, and every score, are those
    of indexing each as it came.

    A search whose terms have long postings (common words in a long history) is summed with numpy
    (``_VECTOR_MIN_POSTINGS``), to the same numbers, so a search costs about the number of its
    terms rather than of their postings."""

    __slots__ = (
        "_chunks", "_df", "_freqs", "_hashes", "_lengths", "_norms", "_positions", "_sequences", "_tfs", "_total",
        "_vectors", "_weights",
    )  # fmt: skip

    def __init__(self, chunks: Iterable[HistoryChunk] = ()) -> None:
        self._chunks: list[HistoryChunk] = []
        self._hashes: set[str] = set()
        #: per indexed chunk (the first ``len(_freqs)`` of ``_chunks``): term -> occurrences; and
        #: its number of terms. The chunks after them wait for ``index_pending``.
        self._freqs: list[dict[str, int]] = []
        self._lengths: list[int] = []
        self._total = 0
        #: term -> number of chunks holding it; term -> those chunks' positions, in order added
        #: (the postings), and the term's occurrences in each (so scoring reads no chunk's dict).
        self._df: dict[str, int] = {}
        self._positions: dict[str, array[int]] = {}
        self._tfs: dict[str, array[int]] = {}
        #: per indexed chunk, BM25's length part of the denominator, ``k1 (1 - b + b dl / avgdl)``;
        #: and per term searched, its postings' ``tf (k1 + 1) / (tf + that)``: BM25 without the
        #: IDF. Both hold until chunks are indexed (the average length moves), and a session's
        #: searches between two compactions ask for many of the same words.
        self._norms: list[float] = []
        self._weights: dict[str, array[float]] = {}
        #: the same per term for searches summed with numpy (``_VECTOR_MIN_POSTINGS``): the
        #: postings' positions and their BM25 parts times the term's IDF (which holds as long as
        #: the parts: both move only when chunks are indexed), as arrays numpy indexes with.
        self._vectors: dict[str, tuple[NDArray[np.int32], NDArray[np.float64]]] = {}
        #: every chunk's ``last_sequence``, in the order added (ties in a ranking go to the newest).
        self._sequences: array[int] = array("q")
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
        """Keep the fresh chunks (their terms are found by the next search: ``index_pending``);
        returns how many there were."""
        new = self.fresh(chunks)
        self._chunks.extend(new)
        self._hashes.update(chunk.content_hash for chunk in new)
        self._sequences.extend(chunk.last_sequence for chunk in new)
        return len(new)

    @property
    def pending(self) -> bool:
        """Whether chunks wait for their terms (``index_pending``)."""
        return len(self._freqs) < len(self._chunks)

    def index_pending(self) -> None:
        """Find the terms of the chunks added since the last search, and update the statistics.

        Not thread-safe against ``add`` or a search of the same index: a caller that runs it in
        a worker thread keeps both out meanwhile. A chunk's term counts are stored last, so
        ``pending`` turns false only once every statistic holds the last chunk."""
        for position in range(len(self._freqs), len(self._chunks)):
            found = document_terms(self._chunks[position])
            freqs: dict[str, int] = {}
            for term in found:
                freqs[term] = freqs.get(term, 0) + 1
            self._lengths.append(len(found))
            self._total += len(found)
            for term, tf in freqs.items():
                self._df[term] = self._df.get(term, 0) + 1
                positions = self._positions.get(term)
                if positions is None:
                    self._positions[term], self._tfs[term] = array("i", (position,)), array("i", (tf,))
                else:
                    positions.append(position)
                    self._tfs[term].append(tf)
            self._freqs.append(freqs)

    def scores(self, wanted: Sequence[str]) -> dict[int, float]:
        """BM25 score of every chunk holding a term of ``wanted`` (repeated terms count once per
        repetition), by position; chunks holding none score 0 and are left out."""
        sums = self._sums(wanted)
        if not isinstance(sums, list):
            nonzero = _numpy().flatnonzero(sums)
            return dict(zip(nonzero.tolist(), sums[nonzero].tolist(), strict=True))
        held = list(itertools.compress(range(len(sums)), sums))
        return dict(zip(held, map(sums.__getitem__, held), strict=True))

    def _sums(self, wanted: Sequence[str]) -> list[float] | NDArray[np.float64]:
        """Every chunk's BM25 score, by position (0 for a chunk holding no term of ``wanted``):
        a list, or a numpy array when the terms' postings are long (``_VECTOR_MIN_POSTINGS``).
        Both add the same parts in the same order (per chunk, a term's ``idf x part`` in the
        query's order), so they hold the same numbers to the bit."""
        self.index_pending()
        n = len(self._chunks)
        if not n or not self._total:
            return []
        k1, b = BM25_K1, BM25_B
        norms, weights = self._norms, self._weights
        if len(norms) != n:  # chunks were indexed since: the average length moved
            avgdl = self._total / n
            norms[:] = [k1 * (1 - b + b * length / avgdl) for length in self._lengths]
            weights.clear()
            self._vectors.clear()
        found = [(term, df) for term in wanted if (df := self._df.get(term)) is not None]
        if sum(len(self._positions[term]) for term, _ in found) >= _VECTOR_MIN_POSTINGS * len(found) > 0:
            return self._vector_sums(found, n)
        saturation = k1 + 1
        # Summed in a list (0.0 + x is x, so each sum is the dict's of the same additions); a
        # chunk holding a term scores > 0, and ``compress`` keeps those in C.
        sums = [0.0] * n
        for term, df in found:
            idf = bm25_idf(n, df)
            positions = self._positions[term]
            parts = weights.get(term)
            if parts is not None:
                for i, part in zip(positions, parts, strict=True):
                    sums[i] += idf * part
                continue
            computed = []
            for i, tf in zip(positions, self._tfs[term], strict=True):
                part = tf * saturation / (tf + norms[i])
                computed.append(part)
                sums[i] += idf * part
            weights[term] = array("d", computed)
        return sums

    def _vector_sums(self, found: list[tuple[str, int]], n: int) -> NDArray[np.float64]:
        """``_sums`` with numpy: every term's parts times its IDF, in the query's order, added up
        per position by one ``bincount``, which adds its weights to their bins in the order given,
        from 0.0: to each chunk, the loop's additions in the loop's order. A term's products are
        kept (``_vectors``): each is the loop's ``idf * part``, the same float64 multiplication."""
        numpy = _numpy()
        norms: NDArray[np.float64] | None = None
        saturation = BM25_K1 + 1
        positions: list[NDArray[np.int32]] = []
        scaled: list[NDArray[np.float64]] = []
        for term, df in found:
            vector = self._vectors.get(term)
            if vector is None:
                held = numpy.array(self._positions[term], dtype=numpy.int32)
                kept = self._weights.get(term)
                if kept is not None:
                    weights = numpy.array(kept, dtype=numpy.float64)
                else:
                    if norms is None:
                        norms = numpy.array(self._norms)
                    tfs = numpy.array(self._tfs[term], dtype=numpy.float64)  # exact: small integers
                    # as the loop computes it: tf x saturation, then / (tf + the chunk's norm)
                    weights = tfs * saturation / (tfs + norms[held])
                vector = self._vectors[term] = (held, bm25_idf(n, df) * weights)
            positions.append(vector[0])
            scaled.append(vector[1])
        sums = numpy.bincount(numpy.concatenate(positions), numpy.concatenate(scaled), n)  # float64: given weights
        return cast("NDArray[np.float64]", sums)

    def search(self, query: str, limit: int) -> list[ScoredChunk]:
        """Up to ``limit`` chunks with score > 0, best first, ties to the newest ``last_sequence``."""
        wanted = weighted_query_terms(query)
        if not wanted or limit <= 0 or not self._chunks:
            return []
        sums = self._sums(wanted)  # indexes the chunks still pending
        chunks = self._chunks
        best: list[int]
        if not isinstance(sums, list):
            numpy = _numpy()
            held = numpy.flatnonzero(sums)
            sequences = numpy.array(self._sequences, dtype=numpy.int64)[held]
            # lexsort's last key is its first: score, then last_sequence, then position, each highest first
            best = held[numpy.lexsort((-held, -sequences, -sums[held]))[:limit]].tolist()
        else:
            best = heapq.nsmallest(
                limit,
                itertools.compress(range(len(sums)), sums),
                key=lambda i: (-sums[i], -chunks[i].last_sequence, -i),
            )
        n = len(chunks)
        # a chunk's rarest term is the first it holds of the query's terms in this order
        by_df = sorted((df, term) for term in set(wanted) if (df := self._df.get(term)) is not None)
        out = []
        for i in best:
            freqs = self._freqs[i]
            rarest = next((df for df, term in by_df if term in freqs), n)
            out.append(ScoredChunk(chunks[i], float(sums[i]), rarest_df=rarest, chunk_count=n, terms=freqs.keys()))
        return out


def rank_chunks(chunks: Sequence[HistoryChunk], query: str, limit: int) -> list[ScoredChunk]:
    """Rank ``chunks`` for ``query`` (duplicates by ``content_hash`` count once); see ``RecallIndex.search``."""
    return RecallIndex(chunks).search(query, limit)
