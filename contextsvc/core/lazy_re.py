"""Regular expressions compiled when first used, not when their module is imported.

A server start imports every module that holds a pattern, while most patterns serve calls that
come later or never (fact lines, recall, breadcrumbs, secret redaction). Compiling ~40 of them at
import was ~25 ms of a start (issue #9); ``lazy`` makes that cost the first call's instead. The
methods are the ``re.Pattern`` methods this code base uses; each costs one extra call.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from typing import Any


class LazyPattern:
    __slots__ = ("_compiled", "_flags", "_source")

    def __init__(self, source: str, flags: int | re.RegexFlag = 0) -> None:
        self._source = source
        self._flags = flags
        self._compiled: re.Pattern[str] | None = None

    @property
    def compiled(self) -> re.Pattern[str]:
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = re.compile(self._source, self._flags)
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


def lazy(source: str, flags: int | re.RegexFlag = 0) -> LazyPattern:
    """``re.compile(source, flags)``, done at the first search, match, sub, split or findall."""
    return LazyPattern(source, flags)
