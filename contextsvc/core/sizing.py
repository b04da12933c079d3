"""The size of text: a tokenizer-free measure that prompt tokens are proportional to.

Characters are a poor measure: on every common BPE vocabulary English prose runs ~0.19
tokens/char, code ~0.25, JSON ~0.35 and Cyrillic 0.24-0.50, so a tokens-per-char line fitted on
one kind of content misprices the next. Tokens follow *pieces* much better: a BPE tokenizer
first splits text into pieces (a word with its leading space, up to three digits, a run of
punctuation, a run of whitespace), and a common piece is one token whatever its length. So the
size of a text is the sum over such pieces of a price by class and length, in *size units* of
about half a token. Real tokens per size unit then sit near 0.5 for prose, code and JSON on all
four vocabularies measured, and within ~0.7x-1.45x of that for Cyrillic and CJK (``bench/tokens``,
bench/RESULTS.md): one calibration slope fits every kind, it lies mid-range in the plausible
[0.25, 1.0], and the fallback ``size / 1.8`` is near the mark instead of 2x high for prose.

Cost: one regex pass per text plus a memoized price per distinct piece; sizes of texts seen
before are memoized too (a view is re-measured every turn from the same stored messages).
Deterministic, pure Python, no tokenizer files. The weights are in ``SizeWeights`` and nowhere
else; changing them changes what persisted calibration observations mean (they are refitted as
new baselines replace them, ``calibration_window`` at a time).
"""

from __future__ import annotations

import base64
import bisect
import functools
import itertools
import operator
import re
import threading
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from contextsvc.core import _cjk_costs
from contextsvc.core.lazy_re import lazy_global

__all__ = [
    "CJK_CLASSES",
    "CLASSES",
    "CYRILLIC_FAMILIES",
    "IDENT_PREFIXED",
    "LEGACY_CLASSES",
    "MESSAGE_FRAME_UNITS",
    "N_UNIT_COLUMNS",
    "TOOL_CALL_FRAME_UNITS",
    "WEIGHTS",
    "CutIndex",
    "SizeWeights",
    "class_units",
    "clear_caches",
    "cut_feature_units",
    "cut_index",
    "cyrillic_family_tokens",
    "feature_units",
    "piece_class",
    "piece_tokens",
    "piece_units",
    "pieces",
    "text_size",
]


@dataclass(slots=True, frozen=True)
class SizeWeights:
    """What a piece costs, in tokens (``units_per_token`` converts to size units).

    Where the numbers come from: every distinct piece of ~600 texts (the ``bench/tokens``
    synthetic corpus, and real files: GPL/Apache licences and the vim user manual for English,
    CPython's stdlib for code, npm/boto3/cfn-lint JSON, vim tutors and gnupg/systemd catalogues
    for Cyrillic, vim tutors for CJK) was counted with the bench's four tokenizers (o200k,
    cl100k, Llama 3, the old Claude vocabulary; cl100k/o200k/Llama 3 split text exactly into
    these pieces, so their counts add up piece by piece), and the mean tokens per piece by class
    and length was read off. Where the vocabularies disagree the middle was taken.
    """

    #: size units per token: one unit is half a typical token, so tokens/unit sits near 0.5.
    units_per_token: int = 2
    #: An ASCII letter run costs 1 token per case "hump" (``Describe``+``Instances``); a hump
    #: longer than ``free_letters`` costs ``per_long_letter`` more per extra letter (rarer
    #: words), and past ``word_letters`` ``per_odd_letter`` (hashes, ids, base64: not words).
    #: ``per_long_letter`` was 0.2: on the fit split of bench/fidelity words of 8-13 letters in
    #: prose, code and JSON ran 0.6-0.85x that price (common long words are one token).
    free_letters: int = 6
    per_long_letter: float = 0.15
    word_letters: int = 12
    per_odd_letter: float = 0.4
    #: A hump of one letter repeated (``"x" * 4000``, the filler of many tests), of a letter that
    #: every vocabulary measured holds in long runs, costs its letters over the run the dearest of
    #: the four holds as one token (each letter repeated 3,200 times through
    #: ``bench/tokens/count.mjs``): ``runs_of_8`` eight letters a token, ``runs_of_4`` four, never
    #: more than the hump price. Priced per letter like a rare word, ``"x" * 4000`` came out at
    #: ~1,290 tokens against 500, and an honest count of it was refused as a truncated prompt.
    #: Other letters run at 3 letters a token or fewer in some vocabulary and keep the hump price
    #: (``"q" * 32``: 9.9; 16 in all four).
    runs_of_8: str = "afxAX"
    runs_of_4: str = "bcdeoyCFMY"
    #: A piece whose prefix char is punctuation other than space, ``_`` or ``.`` (``:aws``,
    #: ``"id``, ``/src``) usually costs an extra token or part of one.
    odd_prefix: float = 0.5
    #: Prefix chars that nearly always stay a token of their own before letters (``:amd64``,
    #: ``+dfsg``, ``~deb12u1``, ``=value``: about 1.0 extra token on every vocabulary measured,
    #: against 0.1-0.5 for ``-``, ``/``, ``(``; fit split of bench/fidelity).
    separate_prefixes: str = ":+~="
    separate_prefix: float = 1.0
    #: Cyrillic run of n letters: ``max(1, cyrillic_base + cyrillic_per_letter * n)``. The
    #: vocabularies disagree 2x here (o200k ~0.25 tokens/letter, cl100k/Claude ~0.5): this is the
    #: middle, so Cyrillic costs 0.7x-1.45x the tokens per unit of Latin-script text by vocabulary.
    #: Was 0.45 + 0.33 n: every vocabulary holds common Russian words whole, so a long word costs
    #: less per letter than a short one (bench/fidelity, fit split, split-half: Cyrillic step error
    #: o200k 3.6 -> 3.2%, cl100k 4.0 -> 3.8% at the median; the level keeps tokens/unit 0.35-0.65).
    cyrillic_base: float = 0.7
    cyrillic_per_letter: float = 0.28
    #: A Cyrillic word with letters outside the Russian alphabet (Ukrainian ``ї є ґ`` and the
    #: dotted i, Belarusian ``ў``, Serbian/Macedonian ``љ њ ђ ћ џ`` and je, dze) costs this many times more: the
    #: vocabularies are Russian-heavy, and such words ran 1.2x-1.6x the tokens per unit of Russian
    #: ones (bench/fidelity, fit split: o200k 1.47x, cl100k 1.59x, Llama 3 1.22x, Claude 1.35x).
    cyrillic_rare_factor: float = 1.45
    #: A Cyrillic word not right after a space (after a line break or punctuation) or with a
    #: capital letter costs this many times more: the vocabularies hold Cyrillic words mostly in
    #: lower case after a space (fit split of bench/fidelity: other Cyrillic words ran ~1.45x the
    #: tokens per unit). A word at the very start of a text is priced as if after a space, so
    #: text added in front never makes anything cheaper.
    cyrillic_unspaced_factor: float = 1.45
    #: Other scripts (accented Latin, Greek, Arabic, ...), per letter, same form.
    other_base: float = 0.8
    other_per_letter: float = 0.28
    #: CJK ideographs, kana and hangul, per character (o200k/Llama 3 ~0.8, cl100k/Claude ~1.3),
    #: where the vocabulary table (``_cjk_costs``) does not cover the character (radicals,
    #: bopomofo, the rarer extension blocks).
    cjk_per_char: float = 1.0
    #: A character the table covers (the unified ideographs, kana, hangul syllables) costs this
    #: many times its mean token count alone over the four vocabularies: a common ideograph (one
    #: token in most) half what a rare one costs (two or three byte-level tokens). A unit
    #: convention only (each family's fitted weight absorbs it): 0.9 keeps the real tokens per
    #: unit of Han, kana and hangul text where they were with ``cjk_per_char`` (0.3-0.6).
    cjk_table_scale: float = 0.9
    #: A punctuation run costs 1 token up to ``free_punct`` chars, then ``per_punct`` per char;
    #: a run of one repeated char (rulers ``=====``) 1 + ``per_repeat`` a piece whatever its length
    #: (pieces are cut at ``_MAX_PIECE`` chars, so 80 ``=`` are three pieces, ~3.4): every
    #: vocabulary measured has ruler tokens of 32-80 chars (o200k, cl100k, Llama 3 and Claude count
    #: 80 ``=`` as 1 token), and a price per char put the floor an honest count is held against
    #: (``calibration.lower_bound``) above the real count of a log with ruler lines.
    free_punct: int = 3
    per_punct: float = 0.45
    per_repeat: float = 0.125
    #: Non-ASCII symbols (quotes, dashes, arrows, ``★ ✓ ✅``) cost extra; emoji cost more: the four
    #: vocabularies spend 1.9-2.7 tokens on an emoji (four UTF-8 bytes) in a run, and about one on
    #: the joiner or variation selector inside a sequence (``👩‍💻``, ``❤️``). A punctuation run is
    #: priced with ASCII punctuation's weight (~0.8 of these tokens: vocabularies merge ASCII
    #: marks). At 1.5 (emoji) and 0.5 (the joiners), emoji chat was priced 15-34 % under cold.
    #: The prices stop where the cheapest vocabulary's honest count still clears
    #: ``calibration.lower_bound`` (below it a count is taken for a truncated prompt): at 2.4 a
    #: spaced emoji rounds to 7 units, and o200k's count of 723 of 1,637 emoji in a row fell below
    #: it (7 at 2.0, as at 1.5); BMP symbols shown as emoji (``✅ ⭐``, one token in o200k) stay at
    #: ``per_symbol`` for the same reason.
    per_symbol: float = 0.5
    per_astral: float = 2.0
    per_joiner: float = 1.0
    #: Chat-template framing the text itself does not show: per message (role header and end
    #: marker: 4-5 tokens in ChatML and Llama 3 templates) and per tool call (its wrapper).
    message_frame: float = 4.0
    tool_call_frame: float = 8.0


WEIGHTS = SizeWeights()
#: Size units of the framing of one message and of one tool call (see ``SizeWeights``).
MESSAGE_FRAME_UNITS = round(WEIGHTS.units_per_token * WEIGHTS.message_frame)
TOOL_CALL_FRAME_UNITS = round(WEIGHTS.units_per_token * WEIGHTS.tool_call_frame)

#: Longest piece the splitter emits: longer runs are split, so the piece cache holds only short
#: strings and a megabyte of one character costs what it should, piece by piece.
_MAX_PIECE = 32

# A BPE pre-tokenizer approximated with ``re`` (the cl100k/o200k rules): a letter run with one
# optional leading non-letter (a space — tried first, as the commonest piece —, punctuation,
# ``_``, a tab); digit groups of up to 3; a punctuation run with an optional leading space and
# trailing newlines; a newline run; a whitespace run, its last space left to the next word.
# ``[^\W\d_]`` is "a letter" in any script. Possessive repeats (``{m,n}+``) skip backtracking.
# The patterns compile at first use, each into its own name (``lazy_global``): ~15 ms of a server's
# start that sizes nothing (issue #9), and nothing per call after it.
_PIECE_SOURCE = (
    rf""" ?[^\W\d_]{{1,{_MAX_PIECE}}}+"""
    rf"""|[^\r\n\w][^\W\d_]{{1,{_MAX_PIECE}}}+"""
    rf"""|_[^\W\d_]{{1,{_MAX_PIECE}}}+"""
    rf"""|\d{{1,3}}+"""
    rf"""| ?(?:[^\s\w]|_){{1,{_MAX_PIECE}}}+[\r\n]{{0,{_MAX_PIECE}}}+"""
    rf"""|\s{{0,{_MAX_PIECE}}}[\r\n]{{1,{_MAX_PIECE}}}+"""
    rf"""|\s{{1,{_MAX_PIECE}}}(?!\S)"""
    rf"""|\s{{1,{_MAX_PIECE}}}+"""
)
_PIECE = lazy_global(globals(), "_PIECE", _PIECE_SOURCE)
#: Whitespace among ASCII characters by Unicode's rule (``str.isspace``): ``\s`` of an ASCII
#: pattern leaves out \x1c-\x1f.
_ASCII_SPACE = r"\s\x1c-\x1f"
# ``_PIECE`` for ASCII text, with ASCII classes: ~20-35 % faster, since ``_PIECE``'s classes look each
# character up in the Unicode database. On ASCII characters the two kinds of class agree but for
# whitespace, which is written out, so both split any ASCII text into the same pieces
# (tests/unit/test_sizing_ascii_pieces.py).
_ASCII_PIECE = lazy_global(
    globals(),
    "_ASCII_PIECE",
    _PIECE_SOURCE.replace(r"[^\s\w]", rf"[^{_ASCII_SPACE}\w]")
    .replace(r"\s{", rf"[{_ASCII_SPACE}]{{")
    .replace(r"(?!\S)", rf"(?![^{_ASCII_SPACE}])"),
    re.ASCII,
)


def _split(text: str) -> list[str]:
    """``text``'s pieces (``_PIECE``), by the ASCII pattern when the text is ASCII."""
    return (_ASCII_PIECE if text.isascii() else _PIECE).findall(text)


_HUMP = lazy_global(globals(), "_HUMP", r"[A-Z]*[a-z]+|[A-Z]+")
_RUN = lazy_global(globals(), "_RUN", r"[A-Za-z]+|[\u0400-\u052f]+|[^A-Za-z\u0400-\u052f]+")
_CJK = lazy_global(
    globals(), "_CJK", r"[\u2e80-\u2fdf\u3040-\u30ff\u3100-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]"
)
#: Cyrillic letters the Russian alphabet does not have (see ``SizeWeights.cyrillic_rare_factor``).
_RARE_CYRILLIC = lazy_global(
    globals(),
    "_RARE_CYRILLIC",
    "[\u0404\u0406\u0407\u0408\u0409\u040a\u040b\u040e\u040f\u0405\u0402\u0490"
    "\u0454\u0456\u0457\u0458\u0459\u045a\u045b\u045e\u045f\u0455\u0452\u0491]",
)
_LINE_BREAKS = lazy_global(globals(), "_LINE_BREAKS", r"[\r\n]+")
_CHEAP_PREFIXES = frozenset("_.")


def pieces(text: str) -> list[str]:
    """``text`` split the way ``text_size`` prices it (every character in exactly one piece)."""
    return _split(text)


def _letters_tokens(letters: str, w: SizeWeights, *, unspaced: bool = False) -> float:
    """Tokens of a run of letters (no prefix), any script; runs of one script priced separately.
    ``unspaced``: the letters do not follow a space (``SizeWeights.cyrillic_unspaced_factor``)."""
    tokens = 0.0
    for run in _RUN.findall(letters) if not letters.isascii() else (letters,):
        if run.isascii():
            for hump in _HUMP.findall(run):
                n = len(hump)
                price = 1.0 + w.per_long_letter * max(0, min(n, w.word_letters) - w.free_letters)
                price += w.per_odd_letter * max(0, n - w.word_letters)
                if n > w.free_letters and hump.count(hump[0]) == n:
                    per_token = 8 if hump[0] in w.runs_of_8 else 4 if hump[0] in w.runs_of_4 else 0
                    if per_token:  # never above the hump price: more letters never make it cheaper
                        price = min(price, max(1.0, n / per_token))
                tokens += price
        elif "\u0400" <= run[0] <= "\u052f":
            cost = max(1.0, w.cyrillic_base + w.cyrillic_per_letter * len(run))
            if _RARE_CYRILLIC.search(run):
                cost *= w.cyrillic_rare_factor
            # a capital anywhere (not only first): text added in front never makes it cheaper
            tokens += cost * w.cyrillic_unspaced_factor if unspaced or not run.islower() else cost
        else:
            cjk = _CJK.findall(run)
            other = len(run) - len(cjk)
            tokens += sum(_cjk_char_tokens(ch, w) for ch in cjk)
            if other:
                tokens += max(1.0, w.other_base + w.other_per_letter * other)
    return tokens


def _cjk_levels() -> tuple[tuple[int, int, int], ...]:
    """(first, end, offset into ``_CJK_LEVELS``) of each block of the vocabulary table."""
    out, offset = [], 0
    for first, end in _cjk_costs.BLOCKS:
        out.append((first, end, offset))
        offset += end - first
    return tuple(out)


#: One byte per code point of ``_cjk_costs.BLOCKS``: the level ``4 x (mean tokens alone - 1)``.
_CJK_LEVELS = zlib.decompress(base64.b64decode("".join(_cjk_costs.PACKED)))
_CJK_BLOCKS = _cjk_levels()
assert len(_CJK_LEVELS) == sum(end - first for first, end in _cjk_costs.BLOCKS)


def _cjk_char_tokens(ch: str, w: SizeWeights) -> float:
    """Tokens of one Han, kana or hangul character: by the vocabulary table where it covers it."""
    code = ord(ch)
    for first, end, offset in _CJK_BLOCKS:
        if first <= code < end:
            return w.cjk_table_scale * (1.0 + _CJK_LEVELS[offset + code - first] / 4)
    return w.cjk_per_char


def _punct_tokens(run: str, w: SizeWeights) -> float:
    """Tokens of a run of punctuation/symbols (no leading space, no trailing newlines)."""
    n = len(run)
    ruler = n > 1 and run.count(run[0]) == n
    tokens = 1.0 + w.per_repeat if ruler else 1.0 + w.per_punct * max(0, n - w.free_punct)
    return tokens + _symbol_extra(run, w)


def _symbol_extra(run: str, w: SizeWeights) -> float:
    """What non-ASCII symbols add: multi-byte characters are spread over more tokens."""
    if run.isascii():
        return 0.0
    return sum(_char_extra(ord(ch), w) for ch in run if ord(ch) > 0x7F)


#: The zero-width joiner and the variation selectors that glue emoji sequences together.
_JOINERS = frozenset((0x200D, 0xFE0E, 0xFE0F))


def _char_extra(code: int, w: SizeWeights) -> float:
    if code > 0xFFFF:
        return w.per_astral
    return w.per_joiner if code in _JOINERS else w.per_symbol


def piece_tokens(piece: str, w: SizeWeights = WEIGHTS, *, inner: bool = False) -> float:
    """Estimated tokens of one piece (as ``pieces`` emits it); at least 1 for any piece.

    ``inner``: the piece is not the first of its text, so a piece of letters follows something
    other than a space (a line break, a digit, punctuation): Cyrillic letters cost more there."""
    last = piece[-1]
    if last.isdecimal():
        return 1.0  # a group of up to 3 digits
    if piece.isspace():
        # One token per line-break run, and one for spaces before the first: ``\s*[\r\n]+``
        # takes the spaces before a line break along, and must not make more text cost less.
        return float(len(_LINE_BREAKS.findall(piece)) + (piece[0] not in "\r\n"))
    if last.isalnum():  # a letter piece (a word char, not a digit), maybe with a prefix char
        head = piece[0]
        if head.isalnum():
            return _letters_tokens(piece, w, unspaced=inner)
        if head == " ":
            return _letters_tokens(piece[1:], w)
        if head in _CHEAP_PREFIXES or head.isspace():
            return _letters_tokens(piece[1:], w, unspaced=True)
        # Never less than the prefix alone would cost, so more text never costs less.
        prefix = w.separate_prefix if head in w.separate_prefixes else w.odd_prefix
        return _letters_tokens(piece[1:], w, unspaced=True) + prefix + _symbol_extra(head, w)
    run = piece.lstrip(" ").rstrip("\r\n")
    return _punct_tokens(run, w) if run else 1.0


@functools.lru_cache(maxsize=1 << 15)
def piece_units(piece: str) -> int:
    """Size units of one piece with the default weights (memoized: pieces repeat a lot), as the
    first piece of a text."""
    return max(1, round(WEIGHTS.units_per_token * piece_tokens(piece)))


@functools.lru_cache(maxsize=1 << 15)
def _inner_units(piece: str) -> int:
    """``piece_units`` of a piece that is not the first of its text (``piece_tokens(inner=True)``)."""
    if not piece[0].isalpha() or piece.isascii():
        return piece_units(piece)  # only a piece starting with a letter depends on what precedes it
    return max(1, round(WEIGHTS.units_per_token * piece_tokens(piece, inner=True)))


def _units(found: list[str]) -> int:
    """Size units of the pieces of one text, in order."""
    if not found:
        return 0
    return piece_units(found[0]) + sum(map(_inner_units, itertools.islice(found, 1, None)))


def text_size(text: str) -> int:
    """Size units of ``text``: the sum of its pieces' units. 0 for the empty string.

    Texts of ``_MEMO_MIN_CHARS`` or more are memoized (``_TextMemo``): a view is rebuilt and
    re-measured every turn from the same stored messages, and splitting them again each time
    would cost 40-90 ms a megabyte (bench/RESULTS.md).
    """
    if len(text) < _MEMO_MIN_CHARS:
        return _units(_split(text))
    size = _MEMO.get(text)
    if size is None:
        size = _units(_split(text))
        _MEMO.put(text, size)
    return size


#: Texts shorter than this are measured directly: cheaper than remembering them.
_MEMO_MIN_CHARS = 16
#: Characters of text the memo may keep alive, counting ``_MEMO_ENTRY_CHARS`` more for each
#: entry's own overhead; most of the text is shared with the stores' own copies of the
#: messages, so this bounds the worst case, not the usual cost.
_MEMO_MAX_CHARS = 8_000_000
_MEMO_ENTRY_CHARS = 100


T = TypeVar("T")


class _TextMemo(Generic[T]):
    """What was measured of recently seen long texts (a size, units), keyed by the text itself,
    oldest dropped first.

    A ``str`` caches its own hash, so a hit on the same object is a dict lookup; an equal copy
    costs one hash and one compare, both far cheaper than the regex pass. A lock keeps it
    consistent if a thread (not only the event loop) measures text.
    """

    __slots__ = ("_chars", "_costs", "_lock", "_max_chars", "_values")

    def __init__(self, max_chars: int) -> None:
        self._values: dict[str, T] = {}
        self._costs: dict[str, int] = {}
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()

    def get(self, text: str) -> T | None:
        return self._values.get(text)

    def put(self, text: str, value: T) -> None:
        """Remember ``value`` for ``text`` (a few numbers: counted as the text it keeps alive)."""
        cost = len(text) + _MEMO_ENTRY_CHARS
        if cost > self._max_chars:
            return
        with self._lock:
            if text in self._values:
                return
            while self._chars + cost > self._max_chars and self._values:
                oldest = next(iter(self._values))
                del self._values[oldest]
                self._chars -= self._costs.pop(oldest)
            self._values[text] = value
            self._costs[text] = cost
            self._chars += cost

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._costs.clear()
            self._chars = 0


#: sizes of long texts (``text_size``)
_MEMO: _TextMemo[int] = _TextMemo(_MEMO_MAX_CHARS)


def clear_caches(*, texts: bool = True, pieces: bool = True) -> None:
    """Forget memoized text sizes and/or piece prices (for benchmarks of the cold cost; sizes
    never change)."""
    if texts:
        _MEMO.clear()
        _CLASS_MEMO.clear()
    if pieces:
        piece_units.cache_clear()
        _inner_units.cache_clear()
        _inner_packed.cache_clear()
        _first_packed.cache_clear()
        piece_class.cache_clear()
        _piece_split.cache_clear()
        _cyrillic_family_units.cache_clear()


# --- content classes: the features the calibration prices (DESIGN §5.3) ----------------------

#: Content classes a piece falls in. Tokens per size unit differ by class and by vocabulary
#: (Cyrillic and the East Asian scripts most), so the calibration prices each class with its own
#: ratio. Han ideographs, kana and hangul are three classes, not one: a vocabulary can be cheap on
#: one and dear on another (cl100k spends about two tokens on a hangul syllable and one on a
#: common kana), and one ``cjk`` class (the first version, ``LEGACY_CLASSES``) priced Japanese,
#: Chinese and Korean text with one ratio, off by more than any fit could recover.
CLASSES: tuple[str, ...] = (
    "word",
    "ident",
    "number",
    "punct",
    "space",
    "cyrillic",
    "han",
    "kana",
    "hangul",
    "other",
)
WORD, IDENT, NUMBER, PUNCT, SPACE, CYRILLIC, HAN, KANA, HANGUL, OTHER = range(len(CLASSES))
N_CLASSES = len(CLASSES)
#: The East Asian classes (what the first version counted as one ``cjk`` class).
CJK_CLASSES: tuple[int, ...] = (HAN, KANA, HANGUL)
#: The classes of the first feature set (observations stored before the split; ``core.priors``
#: maps them).
LEGACY_CLASSES: tuple[str, ...] = ("word", "ident", "number", "punct", "space", "cyrillic", "cjk", "other")
_SINGLE_HUMP = lazy_global(globals(), "_SINGLE_HUMP", r"[A-Z]?[a-z]+|[A-Z]{1,4}")
#: camelCase and PascalCase humps (``getValue``, ``DescribeInstances``): priced as words. Each hump
#: is a word to every vocabulary measured (0.47-0.49 tokens per unit, like words), while ``_name``
#: and ``.attr`` run 0.5 in three vocabularies and 0.97 in Claude's: one ``ident`` ratio for both
#: overpriced camelCase-heavy JSON for Claude (bench/fidelity, fit split, round 9).
#: Written as one first hump and then humps that start upper-case: the same strings as
#: ``(?:[A-Z]?[a-z]+)+``, whose nested repeat split a lower-case run every possible way before
#: failing (``"a" * 30 + "AB"``: minutes of the event loop for one 32-letter piece).
_CAMEL = lazy_global(globals(), "_CAMEL", r"[A-Z]?[a-z]+(?:[A-Z][a-z]+)*")


def _cjk_script(ch: str) -> int:
    """The East Asian class of one character ``_CJK`` matches: kana, hangul, else Han (ideographs,
    radicals, bopomofo and the other CJK marks are priced with the ideographs)."""
    if "\u3040" <= ch <= "\u30ff" or "\u31f0" <= ch <= "\u31ff":
        return KANA
    if "\uac00" <= ch <= "\ud7af" or "\u3130" <= ch <= "\u318f":
        return HANGUL
    return HAN


@functools.lru_cache(maxsize=1 << 15)
def piece_class(piece: str) -> int:
    """The content class (an index into ``CLASSES``) of one piece as ``pieces`` emits it. A piece
    mixing East Asian scripts (Japanese kanji with kana) gets the class most of its characters
    are in; ``class_units`` shares its units between them."""
    return _piece_split(piece)[0][0]


def _classify(piece: str) -> int | tuple[int, int, int]:
    """The class of ``piece``, or for an East Asian piece its character counts (Han, kana, hangul)."""
    last = piece[-1]
    if last.isdecimal():
        return NUMBER
    if piece.isspace():
        return SPACE
    if not last.isalnum():
        return PUNCT
    head = piece[0]
    letters = piece if head.isalnum() else piece[1:]
    if not letters.isascii():
        if any("\u0400" <= ch <= "\u052f" for ch in letters):
            return CYRILLIC
        chars = _CJK.findall(letters)
        if chars:
            counts = [0, 0, 0]
            for ch in chars:
                counts[_cjk_script(ch) - HAN] += 1
            return (counts[0], counts[1], counts[2])
        return OTHER
    if (head.isalnum() or head == " ") and (_SINGLE_HUMP.fullmatch(letters) or _CAMEL.fullmatch(letters)):
        return WORD
    return IDENT  # acronym humps (``HTTPServer``), a ``_``/``.``/punctuation prefix, a tab


@functools.lru_cache(maxsize=1 << 15)
def _piece_split(piece: str) -> tuple[tuple[int, int], ...]:
    """``(class, units)`` of one piece: one pair, or for a piece mixing East Asian scripts its
    units shared by character count (largest remainder, so they still sum to ``piece_units``),
    the class with most characters first. A prefixed identifier (``_name``, ``.attr``) has a
    second pair, its units again in the ``IDENT_PREFIXED`` column (not a class: the classes alone
    still sum to ``piece_units``)."""
    units = piece_units(piece)
    kind = _classify(piece)
    if isinstance(kind, int):
        if kind == IDENT and piece[0] in _CHEAP_PREFIXES:
            return ((IDENT, units), (IDENT_PREFIXED, units))  # counted twice: the column is a price on top
        return ((kind, units),)
    shares = [(n, c) for n, c in zip(kind, CJK_CLASSES, strict=True) if n]
    if len(shares) == 1:
        return ((shares[0][1], units),)
    shares.sort(key=lambda nc: -nc[0])
    total = sum(n for n, _ in shares)
    exact = [units * n / total for n, _ in shares]
    floors = [int(x) for x in exact]
    for i in sorted(range(len(shares)), key=lambda i: exact[i] - floors[i], reverse=True)[: units - sum(floors)]:
        floors[i] += 1
    return tuple((c, u) for (_, c), u in zip(shares, floors, strict=True) if u)


def _inner_split(piece: str) -> tuple[tuple[int, int], ...]:
    """``_piece_split`` of a piece that is not the first of its text (``_inner_units``); kept
    packed (``_inner_packed``), where ``feature_units`` reads it."""
    split = _piece_split(piece)
    inner = _inner_units(piece)
    if inner == piece_units(piece):
        return split
    # Only a piece of letters gets dearer inside a text; its extra units go to its main class.
    return ((split[0][0], split[0][1] + inner - piece_units(piece)), *split[1:])


def class_units(text: str) -> tuple[int, ...]:
    """Size units of ``text`` per content class (``CLASSES`` order); they sum to ``text_size``."""
    return feature_units(text)[:N_CLASSES]


def feature_units(text: str) -> tuple[int, ...]:
    """``class_units`` of ``text``, then its Cyrillic pieces counted in each family's own
    vocabulary (``CYRILLIC_FAMILIES`` order, in size units), then the units of its prefixed
    identifier pieces again (``IDENT_PREFIXED``): ``N_UNIT_COLUMNS`` numbers, the first
    ``len(CLASSES)`` summing to ``text_size``. Text without Cyrillic has 0 in the family columns
    and pays one integer compare per piece for them; the prefixed column comes with the piece's
    memoized split (``_piece_split``), at no cost for a piece that is not one.

    Long texts are memoized like ``text_size``: a view's messages are re-measured every turn.
    The pieces' columns are summed packed (``_packed``): one C-level ``sum`` of one integer per
    piece instead of a Python loop over the pieces.
    """
    if len(text) >= _MEMO_MIN_CHARS:
        hit = _CLASS_MEMO.get(text)
        if hit is not None:
            return hit
    found = _split(text)
    if not found:
        return _NO_UNITS
    # Past ``_PACKED_MAX_CHARS`` a packed field could overflow (never through gRPC's limits).
    out = tuple(_looped_units(found)) if len(text) > _PACKED_MAX_CHARS else _units_of(found)
    if len(text) >= _MEMO_MIN_CHARS:
        _CLASS_MEMO.put(text, out)
    return out


def _units_of(found: Sequence[str], *, first: bool = True) -> tuple[int, ...]:
    """``feature_units`` of consecutive pieces of a text (not past ``_PACKED_MAX_CHARS``);
    ``first``: they start the text (its first piece is priced as one)."""
    if not found:
        return _NO_UNITS
    lead = _first_packed(found[0]) if first else _inner_packed(found[0])
    total = sum(map(_inner_packed, itertools.islice(found, 1, None)), lead)
    units = [(total >> shift) & _FIELD_MASK for shift in _SHIFTS]
    if total >> _CYRILLIC_SHIFT:  # the families' columns need the Cyrillic pieces themselves
        units[N_CLASSES:IDENT_PREFIXED] = _family_columns(found, first=first)
    return tuple(units)


def _plus(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    return tuple(map(operator.add, a, b))


def _minus(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    return tuple(map(operator.sub, a, b))


# --- a cut text's units from the whole one's ------------------------------------------------

#: How far past a piece's start ``_PIECE`` reads: its longest piece is 2 x ``_MAX_PIECE`` + 1
#: characters, and no alternative reads more than one character past that (a lookahead, a repeat
#: that fails); with room to spare. The pattern reads nothing before a piece's start, so a piece
#: starting this far before a cut is the same piece with or without the cut, and so is every
#: piece before it.
_PIECE_REACH = 2 * _MAX_PIECE + 8
#: Pieces between two entries of a text's cut index (``CutIndex``): a cut splits about this
#: many pieces again on either side.
_INDEX_STEP = 32


class CutIndex(NamedTuple):
    """Every ``_INDEX_STEP``-th piece's start in a text (then the text's length), and the units
    of the pieces before each, ``N_UNIT_COLUMNS`` numbers an entry (the whole text's last).

    Kept per message by its caller (``tokens.remember_cut``: dropped with the message), not in a
    text memo: a fleet's long rows are re-cut in turn, and a bounded memo cycled through more of
    them than it held rebuilt every index (issue #15). In 32-bit numbers when they fit
    (~0.3 bytes a character of prose, ~1 for digits and punctuation, whose pieces are short)."""

    starts: array[int]
    before: array[int]

    def units_before(self, k: int) -> tuple[int, ...]:
        return tuple(self.before[k * N_UNIT_COLUMNS : (k + 1) * N_UNIT_COLUMNS])

    def whole(self) -> tuple[int, ...]:
        """``feature_units`` of the whole text."""
        return self.units_before(len(self.starts) - 1)

    @property
    def nbytes(self) -> int:
        return self.starts.itemsize * len(self.starts) + self.before.itemsize * len(self.before)


#: Numbers an ``array("i")`` holds (a text's offsets and cumulative units, when they fit).
_INT32_MAX = 2**31 - 1


def cut_index(text: str) -> CutIndex | None:
    """``text``'s cut index (one pass over its pieces), or None when its pieces do not cover it
    end to end (a cut's units are then measured whole)."""
    found = _split(text)
    if sum(map(len, found)) != len(text) or len(text) > _PACKED_MAX_CHARS:
        return None
    starts, before = [0], list(_NO_UNITS)
    units = _NO_UNITS
    for k in range(0, len(found), _INDEX_STEP):
        chunk = found[k : k + _INDEX_STEP]
        starts.append(starts[-1] + sum(map(len, chunk)))
        units = _plus(units, _units_of(chunk, first=k == 0))
        before.extend(units)
    # Offsets and units only grow: the last of each is the largest.
    return CutIndex(
        array("i" if len(text) <= _INT32_MAX else "q", starts),
        array("i" if max(units) <= _INT32_MAX else "q", before),
    )


def cut_feature_units(text: str, cut: str, head: int, tail: int, index: CutIndex | None = None) -> tuple[int, ...]:
    """``feature_units(cut)`` of ``cut == text[:head] + marker + text[tail:]`` (a view's cut of a
    long field), the same numbers, without splitting all of ``cut`` into pieces: the pieces of
    ``text`` are indexed once (``index``, ``cut_index(text)``: made here when not given), those
    well before ``head`` and from a piece of the tail on which the cut's own pieces land again
    are the text's, and only the pieces between are split. A cut again at another place (each new
    calibration moves it) splits a few hundred characters, not the whole field."""
    if not 0 <= head <= tail <= len(text):
        return feature_units(cut)
    if index is None:
        index = cut_index(text)
        if index is None:
            return feature_units(cut)
    starts = index.starts
    last = len(starts) - 1
    a = max(0, bisect.bisect_right(starts, head - _PIECE_REACH) - 1)
    shift = len(cut) - len(text)  # a tail position in ``cut`` is its position in ``text`` + shift
    b = max(1, bisect.bisect_left(starts, tail))  # (the text priced its first piece as a first)
    ahead = starts[b] + shift  # the next indexed start of the tail, in ``cut``
    middle: list[str] = []
    for match in _PIECE.finditer(cut, starts[a]):
        at = match.start()
        while at > ahead and b < last:
            b += 1
            ahead = starts[b] + shift
        # From here on the cut's pieces are the text's own (unless this is the cut's first piece,
        # which the text priced as an inner one, and the cut prices as a first).
        if at == ahead and (middle or a):
            after = _minus(index.units_before(last), index.units_before(b))
            break
        middle.append(match.group())
    else:
        after = _NO_UNITS
    return _plus(_plus(index.units_before(a), _units_of(middle, first=a == 0)), after)


def _split_at(k: int, piece: str) -> tuple[tuple[int, int], ...]:
    return _piece_split(piece) if k == 0 else _inner_split(piece)


def _looped_units(found: list[str]) -> list[int]:
    """``feature_units`` of a text's pieces, one piece at a time (what the packed sum gives)."""
    units = [0] * N_UNIT_COLUMNS
    for k, piece in enumerate(found):
        for c, u in _split_at(k, piece):
            units[c] += u
    if any(len(split) == 1 and split[0][0] == CYRILLIC for split in itertools.starmap(_split_at, enumerate(found))):
        units[N_CLASSES:IDENT_PREFIXED] = _family_columns(found)
    return units


def _family_columns(found: Sequence[str], *, first: bool = True) -> list[int]:
    """The Cyrillic families' columns of a text's pieces: its Cyrillic pieces (a piece whose split
    is that one class) counted in each family's vocabulary, summed column by column. ``first``:
    the pieces start the text."""
    cyrillic = [
        piece
        for k, piece in enumerate(found, start=0 if first else 1)
        if len(split := _split_at(k, piece)) == 1 and split[0][0] == CYRILLIC
    ]
    return list(map(sum, zip(*map(_cyrillic_family_units, cyrillic), strict=True)))


# --- Cyrillic in each family's own vocabulary -------------------------------------------------

#: Vocabulary families whose own count of a Cyrillic piece is a column of its own (after the
#: classes): the vocabularies disagree about 2x on which Russian words they hold whole (o200k and
#: Llama 3 about 1.6 / 2.5 / 3.2 tokens for a 4 / 8 / 12-letter word, cl100k and Claude 2.7 / 4.3 /
#: 6.2-6.7), so the shared ``cyrillic`` class, one measure for all, priced a family's Cyrillic
#: text 3-5% off at the median where its own count was 1.2-1.9% off (bench/RESULTS.md, round 9).
#: A measured family's prior prices its own column and gives the shared class and the other
#: families' columns no weight; the ``default`` family prices the shared class.
CYRILLIC_FAMILIES: tuple[str, ...] = ("o200k", "cl100k", "llama3", "claude")
#: The column (after the families' Cyrillic columns) that counts the units of identifier pieces with
#: a ``_`` or ``.`` prefix (``_name``, ``.attr``) a second time: they are ``ident`` pieces too, and
#: this is an extra price on top. The old Claude vocabulary spends about twice the tokens on them
#: that it spends on other identifiers (0.97 tokens per unit against 0.5 in the other three
#: vocabularies: bench/RESULTS.md, round 9), which one shared ``ident`` ratio could not price. Only
#: a family whose prior weights it (Claude's) pays for it; every other prior gives it no weight.
IDENT_PREFIXED = len(CLASSES) + len(CYRILLIC_FAMILIES)
#: Numbers ``feature_units`` returns: the classes, one Cyrillic column per family, the prefixed
#: identifiers' column.
N_UNIT_COLUMNS = IDENT_PREFIXED + 1

#: ``feature_units`` adds up a text's pieces as integers: each piece's units per column packed in
#: fields of ``_FIELD_BITS`` bits (column ``c`` at bit ``c * _FIELD_BITS``), and one more field
#: counting Cyrillic pieces. A piece costs at most 8 units a character (an emoji alone: 6), so a
#: field holds the units of 2**37 characters; texts past ``_PACKED_MAX_CHARS`` (64 times the
#: largest request the server accepts by default) are looped.
_FIELD_BITS = 40
_FIELD_MASK = (1 << _FIELD_BITS) - 1
_SHIFTS = tuple(range(0, _FIELD_BITS * N_UNIT_COLUMNS, _FIELD_BITS))
_CYRILLIC_SHIFT = _FIELD_BITS * N_UNIT_COLUMNS
_PACKED_MAX_CHARS = 1 << 32
_NO_UNITS = (0,) * N_UNIT_COLUMNS


def _packed(split: tuple[tuple[int, int], ...]) -> int:
    cyrillic = len(split) == 1 and split[0][0] == CYRILLIC
    return sum(u << (_FIELD_BITS * c) for c, u in split) + (cyrillic << _CYRILLIC_SHIFT)


@functools.lru_cache(maxsize=1 << 12)
def _first_packed(piece: str) -> int:
    """``_packed`` split of a text's first piece."""
    return _packed(_piece_split(piece))


@functools.lru_cache(maxsize=1 << 15)
def _inner_packed(piece: str) -> int:
    """``_packed`` split of a piece that is not the first of its text."""
    return _packed(_inner_split(piece))


_CYRILLIC_RANKS: list[dict[str, int]] = []
_RANKS_LOCK = threading.Lock()


def _cyrillic_ranks() -> list[dict[str, int]]:
    """Per family (``CYRILLIC_FAMILIES`` order), its Cyrillic tokens -> merge rank: imported and
    unpacked at the first Cyrillic piece a process measures (~21k tokens, ~15 ms), so a start-up
    that meets none pays nothing."""
    if not _CYRILLIC_RANKS:
        with _RANKS_LOCK:
            if not _CYRILLIC_RANKS:
                from contextsvc.core import _cyrillic_costs  # 117 KB of source: imported when first needed

                tables = []
                for family in CYRILLIC_FAMILIES:
                    raw = zlib.decompress(base64.b64decode(_cyrillic_costs.PACKED[family]))
                    tables.append({t: r for r, t in enumerate(raw.decode("utf-8").split("\n"))})
                _CYRILLIC_RANKS.extend(tables)
    return _CYRILLIC_RANKS


def _merge_count(letters: str, ranks: dict[str, int]) -> int:
    """Tokens of ``letters`` (Cyrillic, maybe with one leading space) in a vocabulary: byte-pair
    merges replayed by rank over its characters, the lowest-ranked adjacent pair that is a token
    merged first, until no pair is. A character the vocabulary lacks costs 2 (its UTF-8 bytes)."""
    parts = list(letters)
    pair = [ranks.get(a + b, _NO_MERGE) for a, b in itertools.pairwise(parts)]
    while pair:
        best = min(pair)
        if best == _NO_MERGE:
            break
        i = pair.index(best)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pair[i]
        if i > 0:
            pair[i - 1] = ranks.get(parts[i - 1] + parts[i], _NO_MERGE)
        if i < len(pair):
            pair[i] = ranks.get(parts[i] + parts[i + 1], _NO_MERGE)
    return sum(1 if p in ranks or p == " " else 2 for p in parts)


_NO_MERGE = 1 << 30


def cyrillic_family_tokens(piece: str, w: SizeWeights = WEIGHTS) -> tuple[float, ...]:
    """Tokens of a letter piece holding Cyrillic (as ``pieces`` emits it) in each family's own
    vocabulary (``CYRILLIC_FAMILIES`` order): its Cyrillic runs by ``_merge_count`` (a leading
    space merged with the first), other letter runs at the shared price, a prefix other than a
    space one token (plus its ``per_symbol`` if not ASCII). Where it stands in its text does not
    matter: the vocabulary's own count of an unspaced or capitalised word already is dearer."""
    head = piece[0]
    lead, letters, prefix = "", piece, 0.0
    if head == " ":
        lead, letters = " ", piece[1:]
    elif not head.isalnum():
        letters, prefix = piece[1:], 1.0 + _symbol_extra(head, w)
    out = []
    for ranks in _cyrillic_ranks():
        tokens, first = prefix, lead
        for run in _RUN.findall(letters):
            if "\u0400" <= run[0] <= "\u052f":
                tokens += _merge_count(first + run, ranks)
            else:
                tokens += _letters_tokens(run, w)  # a leading space is free, as in ``piece_tokens``
            first = ""
        out.append(tokens)
    return tuple(out)


@functools.lru_cache(maxsize=1 << 15)
def _cyrillic_family_units(piece: str) -> tuple[int, ...]:
    """``cyrillic_family_tokens`` of a piece in size units (at least 1 each), memoized."""
    upt = WEIGHTS.units_per_token
    return tuple(max(1, round(upt * t)) for t in cyrillic_family_tokens(piece))


#: ``feature_units`` of long texts
_CLASS_MEMO: _TextMemo[tuple[int, ...]] = _TextMemo(_MEMO_MAX_CHARS)
