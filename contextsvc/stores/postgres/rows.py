"""Rows of the PostgreSQL store <-> core types.

A message row keeps the codec's JSON (``message_to_dict``) minus ``content`` and ``seq``, which
live in real columns; the columns are the truth for what can change (``is_context``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from contextsvc.core.codec import message_from_dict, message_to_dict
from contextsvc.core.messages import Message
from contextsvc.core.priors import current_cuts, current_features
from contextsvc.core.recall import document_terms
from contextsvc.core.session import SessionInfo
from contextsvc.ports import HistoryChunk, ViewRecord
from contextsvc.stores._session import utc

#: Longest preview kept in the sessions row; listings cut it to ``Settings.preview_chars``.
PREVIEW_KEEP_CHARS = 4096

#: Columns of one message row, in the order ``message_columns`` returns them.
MESSAGE_COLUMNS = ("seq", "role", "is_context", "is_display", "context_key", "content", "create_time", "body")


#: ``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` without building an encoder
#: per call (three per append: two bodies and the event's payload; a test compares the two).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(value: Any) -> str:
    return _ENCODER.encode(value)


def message_columns(messages: Sequence[Message]) -> list[list[Any]]:
    """Column-wise arrays for ``INSERT ... SELECT FROM unnest(...)`` (one round trip per batch)."""
    columns: list[list[Any]] = [[] for _ in MESSAGE_COLUMNS]
    for m in messages:
        body = message_to_dict(m)
        body.pop("content", None)
        body.pop("seq", None)
        values = (
            m.sequence_number,
            m.role.value,
            m.flags.is_context,
            m.flags.is_display,
            m.context_sort_key[0],
            m.content,
            m.create_time,
            dumps(body),
        )
        for column, value in zip(columns, values, strict=True):
            column.append(value)
    return columns


def append_columns(messages: Sequence[Message], now: datetime) -> list[list[Any]]:
    """Column-wise arrays of rows to append, without their sequence numbers (the append statement
    numbers them): role, is_context, is_display, context anchor (0: none), content, create time
    (``now`` where missing), body."""
    roles: list[str] = []
    contexts: list[bool] = []
    displays: list[bool] = []
    anchors: list[int] = []
    contents: list[str] = []
    times: list[datetime] = []
    bodies: list[str] = []
    for m in messages:
        # What ``stamped`` would give, without copying the message: the body is the codec's
        # dict of the stamped row (its time set; content and seq live in columns).
        created = utc(m.create_time) if m.create_time else now
        body = message_to_dict(m)
        body.pop("content", None)
        body.pop("seq", None)
        body["time"] = created.isoformat()
        roles.append(m.role.value)
        contexts.append(m.flags.is_context)
        displays.append(m.flags.is_display)
        anchors.append(m.context_anchor or 0)
        contents.append(m.content)
        times.append(created)
        bodies.append(dumps(body))
    return [roles, contexts, displays, anchors, contents, times, bodies]


def message_from_row(row: Any) -> Message:
    body = dict(row["body"])
    body["seq"] = row["seq"]
    body["content"] = row["content"]
    m = message_from_dict(body)
    if m.flags.is_context != row["is_context"]:
        m = m.with_flags(is_context=row["is_context"])
    return m


def session_from_row(row: Any, preview_chars: int) -> SessionInfo:
    return SessionInfo(
        id=row["session_id"],
        user_id=row["user_id"],
        profile_id=row["profile_id"],
        name=row["name"],
        pinned=row["pinned"],
        metadata=dict(row["metadata"]),
        create_time=row["create_time"],
        update_time=row["update_time"],
        context_tokens=row["context_tokens"],
        context_truncated=row["context_truncated"],
        display_message_count=row["display_count"],
        context_message_count=row["context_count"],
        last_sequence=row["last_sequence"],
        preview=row["preview"][:preview_chars],
        state=dict(row["state"]),
    )


def view_from_row(row: Any) -> ViewRecord:
    return ViewRecord(
        view_id=row["view_id"],
        model=row["model"],
        chars=row["chars"],
        estimated_tokens=row["estimated_tokens"],
        had_images=row["had_images"],
        last_sequence=row["last_sequence"],
        create_time=row["create_time"],
        epoch=row["epoch"],
        features=current_features(row["features"] or ()) if "features" in row else (),
        incoming_tokens=row.get("incoming_tokens", 0),
        priced_tokens=row.get("priced_tokens", 0),
        image_tokens=row.get("image_tokens", 0),
        shape=row.get("shape", ""),
        cuts=current_cuts(row.get("cuts")),
    )


def chunk_from_row(row: Any) -> HistoryChunk:
    return HistoryChunk(
        content_hash=row["content_hash"],
        text=row["text"],
        first_sequence=row["first_sequence"],
        last_sequence=row["last_sequence"],
        start_time=row["start_time"],
        end_time=row["end_time"],
        breadcrumbs=tuple(str(b) for b in row["breadcrumbs"]),
    )


def chunk_columns(chunks: Sequence[HistoryChunk]) -> list[list[Any]]:
    """Column-wise arrays of history chunks, their search terms included (as JSON arrays: an
    array of arrays cannot be ragged in PostgreSQL)."""
    columns: list[list[Any]] = [[] for _ in range(9)]
    for c in chunks:
        found = document_terms(c)
        values = (
            c.content_hash,
            c.text,
            c.first_sequence,
            c.last_sequence,
            utc(c.start_time) if c.start_time is not None else None,
            utc(c.end_time) if c.end_time is not None else None,
            dumps(list(c.breadcrumbs)),
            dumps(found),
            len(found),
        )
        for column, value in zip(columns, values, strict=True):
            column.append(value)
    return columns


def newest_preview(messages: Sequence[Message]) -> str | None:
    """The preview these rows set (newest display row with content), None if they set none."""
    for m in reversed(messages):
        if m.flags.is_display and m.content:
            return m.content[:PREVIEW_KEEP_CHARS]
    return None


def stamped(messages: Sequence[Message], first_sequence: int, now: datetime) -> list[Message]:
    """Assign sequence numbers from ``first_sequence`` and a create time where missing."""
    return [
        dataclasses.replace(
            m, sequence_number=first_sequence + i, create_time=utc(m.create_time) if m.create_time else now
        )
        for i, m in enumerate(messages)
    ]


def like_pattern(query: str) -> str:
    """``%query%`` for ILIKE, with the pattern characters escaped (backslash is LIKE's escape)."""
    escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"
