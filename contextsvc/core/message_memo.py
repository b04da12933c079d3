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
from collections.abc import Callable
from typing import Generic, TypeVar

from contextsvc.core.messages import Message

__all__ = ["IdentityMemo"]

T = TypeVar("T")


class IdentityMemo(Generic[T]):
    """``get(m, compute)`` is ``compute(m)``, computed once per live ``Message`` object."""

    __slots__ = ("__weakref__", "_entries")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Message], T]] = {}

    def get(self, m: Message, compute: Callable[[Message], T]) -> T:
        key = id(m)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is m:
            return entry[1]
        value = compute(m)
        entries = self._entries

        def forget(ref: weakref.ref[Message], key: int = key) -> None:
            # The id may already name a newer object with its own entry: drop only ours.
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(m, forget), value)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
