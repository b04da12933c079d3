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
            if _DIGIT.search(text) is not None:
                return True
        elif isinstance(need, LazyPattern):
            if need.search(text) is not None:
                return True
        elif need in text:
            return True
    return False


def lazy(source: str, flags: int | re.RegexFlag = 0) -> LazyPattern:
    """``re.compile(source, flags)``, done at the first search, match, sub, split or findall."""
    return LazyPattern(source, flags)


def lazy_global(namespace: dict[str, Any], name: str, source: str, flags: int | re.RegexFlag = 0) -> re.Pattern[str]:
    """``lazy`` for the module-level ``name`` of ``namespace`` (the module's ``globals()``): the
    first use compiles the pattern and puts it in that name. Typed as the pattern it becomes; until
    then the name holds a ``LazyPattern``, which has the methods the module calls."""
    return cast("re.Pattern[str]", LazyPattern(source, flags, (namespace, name)))
