"""Plain-JSON form of messages and sessions, shared by every store that serializes rows."""

from __future__ import annotations

import copy
import functools
from datetime import datetime
from typing import Any

from contextsvc.core.messages import DEFAULT_FLAGS, Flags, ImageRef, Message, Role, ToolCall, make_message
from contextsvc.core.session import SessionInfo

_FLAG_NAMES = tuple(Flags.__dataclass_fields__)
_SCALARS = frozenset({str, int, float, bool, type(None)})


def copy_plain(value: Any) -> Any:
    """A deep copy of a JSON-like value (dicts, lists, scalars), as ``copy.deepcopy`` makes one but
    without its memo and dispatch (~3x faster: stores copy session state and metadata on every
    change). Such a value has no cycles and no sharing that means anything; anything else in it
    goes through ``copy.deepcopy``."""
    kind = type(value)
    if kind is dict:
        return {k: copy_plain(v) for k, v in value.items()}
    if kind in _SCALARS:
        return value
    if kind is list:
        return [copy_plain(v) for v in value]
    return copy.deepcopy(value)


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def parse_time(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def message_to_dict(m: Message, *, raw_time: bool = False) -> dict[str, Any]:
    """Compact dict: defaults are left out so logs stay small. ``raw_time``: ``time`` stays a
    ``datetime``, for a writer that formats it as ``isoformat`` does, faster (the files store's)."""
    d: dict[str, Any] = {"seq": m.sequence_number, "role": m.role.value}
    if m.content:
        d["content"] = m.content
    if m.images:
        d["images"] = [
            {
                "blob_id": i.blob_id,
                "mime_type": i.mime_type,
                "width": i.width,
                "height": i.height,
                "size_bytes": i.size_bytes,
                "token_count": i.token_count,
            }
            for i in m.images
        ]
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "name": c.name, "arguments_json": c.arguments_json} for c in m.tool_calls]
    for key in ("tool_call_id", "name", "thinking"):
        value = getattr(m, key)
        if value:
            d[key] = value
    flags = _changed_flags(m.flags)
    if flags:
        d["flags"] = dict(flags)
    if m.metadata:
        d["metadata"] = m.metadata
    if m.create_time is not None:
        d["time"] = m.create_time if raw_time else _time(m.create_time)
    if m.token_count:
        d["tokens"] = m.token_count
    if m.replaces is not None:
        d["replaces"] = list(m.replaces)
    if m.context_anchor:
        d["anchor"] = m.context_anchor
    return d


@functools.lru_cache(maxsize=256)
def _changed_flags(flags: Flags) -> tuple[tuple[str, bool], ...]:
    """The flags that differ from the defaults, by name: worked out once per combination (a
    handful occur), as every row written is encoded."""
    return tuple((n, getattr(flags, n)) for n in _FLAG_NAMES if getattr(flags, n) != getattr(DEFAULT_FLAGS, n))


_ROLES = {role.value: role for role in Role}


def message_from_dict(d: dict[str, Any]) -> Message:
    """The message ``message_to_dict`` wrote (a log's row: made once per row read, so each field
    is set straight, ``make_message``; rows without flags share ``DEFAULT_FLAGS``)."""
    role = d["role"]
    images = d.get("images")
    calls = d.get("tool_calls")
    flags = d.get("flags")
    replaces = d.get("replaces")
    return make_message(
        role=_ROLES.get(role) or Role(role),  # (an unknown role raises ValueError, as Role() does)
        content=d.get("content", ""),
        images=tuple(ImageRef(**i) for i in images) if images else (),
        tool_calls=tuple(ToolCall(**c) for c in calls) if calls else (),
        tool_call_id=d.get("tool_call_id", ""),
        name=d.get("name", ""),
        thinking=d.get("thinking", ""),
        flags=Flags(**flags) if flags else DEFAULT_FLAGS,
        metadata=d.get("metadata", {}),
        sequence_number=int(d.get("seq", 0)),
        create_time=parse_time(d.get("time")),
        token_count=int(d.get("tokens", 0)),
        replaces=(int(replaces[0]), int(replaces[1])) if replaces else None,
        context_anchor=int(d.get("anchor", 0)),
    )


def session_to_dict(s: SessionInfo) -> dict[str, Any]:
    """Header fields only; counters are derived from the rows by the stores."""
    return {
        "id": s.id,
        "user_id": s.user_id,
        "profile_id": s.profile_id,
        "name": s.name,
        "pinned": s.pinned,
        "metadata": s.metadata,
        "create_time": _time(s.create_time),
        "update_time": _time(s.update_time),
        "context_tokens": s.context_tokens,
        "context_truncated": s.context_truncated,
        "state": s.state,
    }


def session_from_dict(d: dict[str, Any], **counters: Any) -> SessionInfo:
    """The header fields of ``d``; ``counters`` (display/context counts, last sequence, preview)
    are given by a reader that keeps them beside the header, as the start-up index does."""
    return SessionInfo(
        **counters,
        id=d["id"],
        user_id=d["user_id"],
        profile_id=d.get("profile_id", ""),
        name=d.get("name", ""),
        pinned=bool(d.get("pinned", False)),
        metadata=d.get("metadata") or {},
        create_time=parse_time(d.get("create_time")),
        update_time=parse_time(d.get("update_time")),
        context_tokens=int(d.get("context_tokens", 0)),
        context_truncated=bool(d.get("context_truncated", False)),
        state=d.get("state") or {},
    )
