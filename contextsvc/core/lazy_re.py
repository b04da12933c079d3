"""Regular expressions compiled when first used, not when their module is imported.

A server start imports every module that holds a pattern, while most patterns serve calls that
come later or never (fact lines, recall, breadcrumbs, secret redaction). Compiling ~40 of them at
import was ~25 ms of a start (issue #9); ``lazy`` makes that cost the first call's instead. The
methods are the ``re.Pattern`` methods this code base uses; each costs one extra call, except for a
pattern bound to a module-level name (``lazy(..., bind=(globals(), "NAME"))``): its first use puts
the compiled pattern in that name, so the module's own code pays nothing after it (the hot path's
sizing patterns).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast


class LazyPattern:
    __slots__ = ("_bind", "_compiled", "_flags", "_source")

    def __init__(
        self, source: str, flags: int | re.RegexFlag = 0, bind: tuple[dict[str, Any], str] | None = None
    ) -> None:
        self._source = source
        self._flags = flags
        self._bind = bind
        self._compiled: re.Pattern[str] | None = None

    @property
    def compiled(self) -> re.Pattern[str]:
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = re.compile(self._source, self._flags)
            if self._bind is not None:
                namespace, name = self._bind
                namespace[name] = compiled  # the module's later look-ups find the pattern itself
        return compiled

    @property
    def pattern(self) -> str:
        return self._source

    def search(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        return self.compiled.search(string, pos, endpos)

    def match(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        return self.compiled.match(string, pos, endpos)

    def fullmatch(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        return self.compiled.fullmatch(string, pos, endpos)

    def findall(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> list[Any]:
        return self.compiled.findall(string, pos, endpos)

    def finditer(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> Iterator[re.Match[str]]:
        return self.compiled.finditer(string, pos, endpos)

    def sub(self, repl: str | Callable[[re.Match[str]], str], string: str, count: int = 0) -> str:
        return self.compiled.sub(repl, string, count)

    def split(self, string: str, maxsplit: int = 0) -> list[str | Any]:
        return self.compiled.split(string, maxsplit)

    def __repr__(self) -> str:
        return f"lazy({self._source!r})"


#: A ``may_match`` need: any decimal digit, as ``\\d`` matches one (Unicode digits too).
DIGIT = "\\d"
_DIGIT = re.compile(r"\d")


def has_digit(text: str) -> bool:
    """Whether ``\\d`` finds a digit in ``text``. In ASCII text the only digits are ``0-9``, and
    ten C-level substring searches take a third of the time of one ``\\d`` scan in ``re``."""
    if text.isascii():
        return any(digit in text for digit in "0123456789")
    return _DIGIT.search(text) is not None


def may_match(text: str, needs: tuple[str | LazyPattern, ...] | None) -> bool:
    """Whether ``text`` holds one of ``needs`` (literal substrings, ``DIGIT``, or a gate: a simple
    pattern found in every text the guarded pattern matches): a pattern that cannot match without
    one of them is not run over a text that holds none (its scan finds nothing there: skipping it
    changes no result). None: the pattern needs nothing in particular.

    Each need is a C-level substring search (one for ``DIGIT``), far cheaper than a pattern's scan
    in ``re``: most prose holds no ``://``, ``@`` or ``%`` (issue #15: a compaction's entity,
    fact and recall scans). A gate is one scan of a pattern without alternatives that backtrack
    over whole words; list it after the substrings, which are cheaper."""
    if needs is None:
        return True
    for need in needs:
        if need is DIGIT:
            if has_digit(text):
                return True
        elif isinstance(need, LazyPattern):
            if need.search(text) is not None:
                return True
        elif need in text:
            return True
    return False


class FoldedPattern:
    """A pattern searched without regard to case, the cheap way where that finds the same.

    ``re.I`` makes ``re`` fold every character it compares, so an alternation of words scans 2-4x
    slower than without it. Over ASCII text, the pattern (written in lower case) searched without
    ``re.I`` in the text lower-cased finds a match exactly where the ``re.I`` search does: ASCII
    folding is lower-casing, and lower-casing moves no position and changes no word character.
    Other text is searched with ``re.I`` as written: Unicode folding also lets the dotless i
    (U+0131), the long s (U+017F) and the Kelvin sign (U+212A) match ``i``, ``s`` and ``k``, which
    lower-casing does not do. A match found the cheap way is a match in the lower-cased text (its
    groups are lower case)."""

    __slots__ = ("_cased", "_folded")

    def __init__(self, source: str) -> None:
        if any(c.isupper() for c in re.sub(r"\\.", "", source)):
            raise ValueError(f"a folded pattern is written in lower case (escapes aside): {source!r}")
        self._cased = LazyPattern(source)
        self._folded = LazyPattern(source, re.I)

    @property
    def pattern(self) -> str:
        return self._cased.pattern

    def search(self, string: str) -> re.Match[str] | None:
        if string.isascii():
            return self._cased.search(string.lower())
        return self._folded.search(string)

    def finditer(self, string: str) -> Iterator[re.Match[str]]:
        if string.isascii():
            return self._cased.finditer(string.lower())
        return self._folded.finditer(string)

    def __repr__(self) -> str:
        return f"folded({self.pattern!r})"


def folded(source: str) -> FoldedPattern:
    """``lazy(source, re.I)`` for ``search``, faster over ASCII text (``FoldedPattern``)."""
    return FoldedPattern(source)


def lazy(source: str, flags: int | re.RegexFlag = 0) -> LazyPattern:
    """``re.compile(source, flags)``, done at the first search, match, sub, split or findall."""
    return LazyPattern(source, flags)


def lazy_global(namespace: dict[str, Any], name: str, source: str, flags: int | re.RegexFlag = 0) -> re.Pattern[str]:
    """``lazy`` for the module-level ``name`` of ``namespace`` (the module's ``globals()``): the
    first use compiles the pattern and puts it in that name. Typed as the pattern it becomes; until
    then the name holds a ``LazyPattern``, which has the methods the module calls."""
    return cast("re.Pattern[str]", LazyPattern(source, flags, (namespace, name)))
