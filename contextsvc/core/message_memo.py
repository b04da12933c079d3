"""Work done once per stored message, not once per build (issue #15, item 1).

A stored message is immutable (a flag change makes a new ``Message``), and the stores hand the
engine the same objects build after build (memory and files keep them; PostgreSQL re-reads them,
and its texts hit ``sizing``'s text memo instead). So what a message costs to price is computed
the first time it is asked for and remembered *for that object*: keyed by identity, held by a
weak reference, and dropped when the message is freed. The memo never keeps a message alive,
never outlives it, and holds one small entry per live message, so its memory is bounded by the
messages the process holds anyway.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from contextsvc.core.messages import Message

__all__ = ["IdentityMemo"]

T = TypeVar("T")


class _Entry(weakref.ref):  # type: ignore[type-arg]  # a weak reference to the message, carrying its value
    """A memo entry: the weak reference itself holds the key and the value, so an entry is one
    object (no tuple, no closure per message: about 100 bytes instead of 430, issue #9)."""

    __slots__ = ("key", "value")
    key: int
    value: object


class IdentityMemo(Generic[T]):
    """``get(m, compute)`` is ``compute(m)``, computed once per live ``Message`` object."""

    __slots__ = ("__weakref__", "_drop", "_entries")

    def __init__(self) -> None:
        entries: dict[int, _Entry] = {}
        self._entries = entries

        def drop(ref: _Entry) -> None:
            # The id may already name a newer object with its own entry: drop only ours.
            if entries.get(ref.key) is ref:
                del entries[ref.key]

        # One callback for every entry (a closure per entry cost ~250 bytes a message).
        self._drop = drop

    def get(self, m: Message, compute: Callable[[Message], T]) -> T:
        key = id(m)
        entry = self._entries.get(key)
        if entry is not None and entry() is m:
            return entry.value  # type: ignore[return-value]
        value = compute(m)
        self.put(m, value)
        return value

    def get_each(self, messages: Iterable[Message], compute: Callable[[Message], T]) -> list[T]:
        """``[get(m, compute) for m in messages]``, with one call for the whole list (a view asks
        for every row's value)."""
        entries = self._entries
        out: list[T] = []
        for m in messages:
            entry = entries.get(id(m))
            out.append(entry.value if entry is not None and entry() is m else self.get(m, compute))  # type: ignore[arg-type]
        return out

    def put(self, m: Message, value: T) -> None:
        """Remember ``value`` for ``m`` (measured another way than ``compute``, to the same result)."""
        entry = _Entry(m, self._drop)
        entry.key = id(m)
        entry.value = value
        self._entries[entry.key] = entry

    def carry(self, src: Message, dst: Message) -> None:
        """Give ``dst`` the value remembered for ``src`` (nothing when there is none): for a copy
        made by the stores or the engine that changes none of what ``compute`` reads."""
        entry = self._entries.get(id(src))
        if entry is None or entry() is not src:
            return
        value = entry.value
        entry = _Entry(dst, self._drop)
        entry.key = id(dst)
        entry.value = value
        self._entries[entry.key] = entry

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
