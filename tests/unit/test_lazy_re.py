"""Patterns compiled on first use (``core/lazy_re.py``): the same answers as ``re``, no compile
before the first call, and a module-level name bound to the compiled pattern after it."""

from __future__ import annotations

import re

from contextsvc.core.lazy_re import LazyPattern, lazy, lazy_global


def test_a_lazy_pattern_answers_as_re_does_and_compiles_once() -> None:
    source, text = r"(\w+)@(\w+)\.com", "mail ann@example.com, bob@test.com now"
    pattern = lazy(source, re.I)
    assert pattern._compiled is None  # nothing compiled by making it
    real = re.compile(source, re.I)
    assert pattern.findall(text) == real.findall(text)
    assert [m.span() for m in pattern.finditer(text)] == [m.span() for m in real.finditer(text)]
    assert pattern.search(text).span() == real.search(text).span()  # type: ignore[union-attr]
    assert pattern.match(text) is None and pattern.fullmatch("ann@x.com") is not None
    assert pattern.sub("<at>", text) == real.sub("<at>", text)
    assert pattern.split(text) == real.split(text)
    first = pattern.compiled
    assert pattern.compiled is first and pattern.pattern == source


def test_a_bound_pattern_replaces_its_name_at_first_use() -> None:
    namespace: dict[str, object] = {}
    namespace["WORDS"] = lazy_global(namespace, "WORDS", r"[a-z]+")
    assert isinstance(namespace["WORDS"], LazyPattern)
    assert namespace["WORDS"].findall("ab 12 cd") == ["ab", "cd"]
    assert isinstance(namespace["WORDS"], re.Pattern)  # later look-ups cost nothing extra
