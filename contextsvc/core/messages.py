"""Messages and their flags, as the core sees them (never protobuf)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class BufferKind(StrEnum):
    DISPLAY = "display"
    CONTEXT = "context"


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str = ""


@dataclass(slots=True, frozen=True)
class ImageRef:
    """An image stored once in the blob store, addressed by the SHA-256 of its bytes."""

    blob_id: str
    mime_type: str = ""
    width: int = 0
    height: int = 0
    size_bytes: int = 0
    token_count: int = 0


@dataclass(slots=True, frozen=True)
class Flags:
    is_context: bool = True
    is_display: bool = True
    is_summary: bool = False
    is_compression: bool = False
    is_compression_critical: bool = False
    is_plan: bool = False
    is_recall: bool = False
    is_pinned: bool = False


#: The flags of a message given none: frozen, so every such message shares this one object.
DEFAULT_FLAGS = Flags()


@functools.lru_cache(maxsize=256)
def _flags_with(flags: Flags, **changes: bool) -> Flags:
    """``flags`` with ``changes``, one object per combination: a compaction changes the same flag
    of hundreds of rows, and ``dataclasses.replace`` walks the fields' definitions each time."""
    return dataclasses.replace(flags, **changes)


@dataclass(slots=True, frozen=True, weakref_slot=True)
class Message:
    """One stored row. ``sequence_number`` is 0 until the store assigns it.

    Weakly referenceable, so per-message caches (``core.message_memo``) can follow its life.

    ``context_anchor`` places a context-only row in the context order at the position of another
    sequence number (a summary sits where the first message it replaced was; a cleared tool result
    placeholder sits where its original was). 0 means "at its own sequence number".
    """

    role: Role
    content: str = ""
    images: tuple[ImageRef, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    thinking: str = ""
    flags: Flags = DEFAULT_FLAGS
    metadata: dict[str, Any] = field(default_factory=dict)
    sequence_number: int = 0
    create_time: datetime | None = None
    token_count: int = 0
    replaces: tuple[int, int] | None = None
    context_anchor: int = 0

    def with_flags(self, **changes: bool) -> Message:
        return _copy_with(self, flags=_flags_with(self.flags, **changes))

    def copy_with(self, **changes: Any) -> Message:
        """``dataclasses.replace(self, **changes)``, without its walk over the fields' definitions
        on every call (each appended row is copied twice: by the engine, then by the store)."""
        return _copy_with(self, **changes)

    @property
    def source(self) -> str:
        """``metadata.source`` of a stored system record ('' when absent)."""
        value = self.metadata.get("source", "")
        return value if isinstance(value, str) else ""

    @property
    def context_sort_key(self) -> tuple[int, int]:
        return (self.context_anchor or self.sequence_number, self.sequence_number)


_MESSAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Message))

#: What the two written-out functions below see: each field's slot setter, ``_set_<field>``
#: (what ``object.__setattr__(new, "<field>", value)`` does, without looking the name up on every
#: call: ``copy_with`` 1.0 against 1.5 µs with ``object.__setattr__``), and ``_new``.
_SLOT_SETTERS: dict[str, Any] = {f"_set_{n}": getattr(Message, n).__set__ for n in _MESSAGE_FIELDS}


def _written_out(name: str, source: str, **scope: Any) -> Callable[..., Message]:
    """Compile ``source`` (our own, made from the field names above) and return ``name`` from it."""
    namespace: dict[str, Any] = {"_new": object.__new__, "Message": Message, **_SLOT_SETTERS, **scope}
    exec(source, namespace)
    made: Callable[..., Message] = namespace[name]
    return made


def _written_out_copy_with() -> Callable[..., Message]:
    """``Message.copy_with``'s work: one keyword and one line per field, made from the field list
    as ``dataclasses`` makes ``__init__`` (a loop over the field names with ``getattr`` and a dict
    of changes cost about twice as much, and an append copies each row twice: issue #15)."""
    lines = [f"    _set_{n}(new, self.{n} if {n} is _KEEP else {n})" for n in _MESSAGE_FIELDS]
    source = (
        f"def copy_with(self, *, {', '.join(f'{n}=_KEEP' for n in _MESSAGE_FIELDS)}, **unknown):\n"
        "    if unknown:\n"
        "        raise TypeError(f\"Message has no field {', '.join(sorted(unknown))}\")\n"
        "    new = _new(Message)\n" + "\n".join(lines) + "\n    return new\n"
    )
    return _written_out("copy_with", source, _KEEP=object())


def _written_out_make() -> Callable[..., Message]:
    """``make_message``: every field by keyword, each one required, set straight into its slot."""
    lines = [f"    _set_{n}(new, {n})" for n in _MESSAGE_FIELDS]
    source = (
        f"def make_message(*, {', '.join(_MESSAGE_FIELDS)}):\n"
        "    new = _new(Message)\n" + "\n".join(lines) + "\n    return new\n"
    )
    return _written_out("make_message", source)


_copy_with = _written_out_copy_with()

#: ``Message(...)`` given every field (by keyword; a field left out is a ``TypeError``), made
#: without ``__init__``'s default handling: 1.1 against 5.4 µs (``timeit``). A store reading a
#: log makes one per row; reading a session again is what a call on a session let go past
#: ``files.cache_mb`` pays (``bench/store/reload.py``). The caller gives each field a value of
#: its type (nothing is checked, as ``__init__`` checks nothing either).
make_message: Callable[..., Message] = _written_out_make()


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def text_bytes(m: Message) -> int:
    """UTF-8 bytes of ``m``'s text fields (content, thinking, name, tool call id, each tool call's
    id, name and arguments): what its text weighs in a response."""
    size = _utf8_len(m.content) + _utf8_len(m.thinking) + _utf8_len(m.name) + _utf8_len(m.tool_call_id)
    for call in m.tool_calls:
        size += _utf8_len(call.id) + _utf8_len(call.name) + _utf8_len(call.arguments_json)
    return size


def context_order(rows: list[Message]) -> list[Message]:
    """The context buffer: rows flagged ``is_context``, in context order."""
    return sorted((m for m in rows if m.flags.is_context), key=lambda m: m.context_sort_key)
