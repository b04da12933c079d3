"""Principals, message builders and snapshots shared by the conformance tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from contextsvc.config import Settings
from contextsvc.core.messages import BufferKind, Flags, ImageRef, Message, Role, ToolCall
from contextsvc.core.session import Principal, SessionInfo
from contextsvc.ports import Clock, SessionStore, ViewRecord
from tests.support.stores import Backing

ALICE = Principal(user_id="alice")
BOB = Principal(user_id="bob")
ADMIN = Principal(user_id="operator", is_admin=True)


def user(content: str = "hi", **flags: bool) -> Message:
    return Message(role=Role.USER, content=content, flags=Flags(**flags))


def assistant(content: str = "", *call_ids: str) -> Message:
    calls = tuple(ToolCall(id=c, name="shell", arguments_json=f'{{"cmd": "ls {c}"}}') for c in call_ids)
    return Message(role=Role.ASSISTANT, content=content, tool_calls=calls)


def tool(call_id: str, content: str = "ok") -> Message:
    return Message(role=Role.TOOL, content=content, tool_call_id=call_id, name="shell")


def summary(content: str, *, anchor: int, replaces: tuple[int, int]) -> Message:
    """A context-only summary placed where the first message it replaced was."""
    return Message(
        role=Role.USER,
        content=content,
        flags=Flags(is_summary=True, is_display=False),
        context_anchor=anchor,
        replaces=replaces,
    )


def compression_record(content: str) -> Message:
    """The display-only service record every compaction appends."""
    return Message(
        role=Role.SYSTEM,
        content=content,
        flags=Flags(is_context=False, is_compression=True),
        metadata={"source": "compression"},
    )


def image(n: int) -> ImageRef:
    return ImageRef(
        blob_id=f"{n:064x}", mime_type="image/png", width=64 + n, height=32, size_bytes=100 + n, token_count=258
    )


def seqs(rows: Sequence[Message]) -> list[int]:
    return [m.sequence_number for m in rows]


def without_store_fields(m: Message) -> Message:
    """The message as the caller sent it (the store assigns number and time)."""
    return dataclasses.replace(m, sequence_number=0, create_time=None)


async def all_rows(store: SessionStore, sid: str, buffer: BufferKind, page: int = 7) -> list[Message]:
    """Every row of a buffer, fetched page by page from the newest back (as a client would)."""
    pages: list[list[Message]] = []
    before = 0
    position: tuple[int, int] | None = None
    while True:
        rows = await store.list_messages(
            sid, caller=ADMIN, buffer=buffer, before_sequence=before, before_position=position, limit=page
        )
        if not rows:
            break
        pages.append(rows)
        # The display buffer is in sequence order; the context buffer pages by position.
        if buffer is BufferKind.CONTEXT:
            position = rows[0].context_sort_key
        else:
            before = rows[0].sequence_number
    out: list[Message] = []
    for rows in reversed(pages):
        out.extend(rows)
    return out


async def snapshot(store: SessionStore, sid: str) -> dict[str, Any]:
    """Everything a reader can see of one session."""
    info: SessionInfo = await store.get_session(sid, caller=ADMIN)
    return {
        "info": info,
        "rows": await store.get_messages(sid, caller=ADMIN, first=1, last=info.last_sequence),
        "context": await store.load_context(sid, caller=ADMIN),
        "display_pages": await all_rows(store, sid, BufferKind.DISPLAY),
        "context_pages": await all_rows(store, sid, BufferKind.CONTEXT),
    }


def view(view_id: str, *, last_sequence: int = 1, epoch: int = 0) -> ViewRecord:
    return ViewRecord(
        view_id=view_id,
        model="m",
        chars=1000 + last_sequence,
        estimated_tokens=500,
        had_images=last_sequence % 2 == 0,
        last_sequence=last_sequence,
        create_time=datetime(2026, 1, 1, 12, 0, last_sequence % 60, tzinfo=UTC),
        epoch=epoch,
    )


class Reopen:
    """Close the current store and open a fresh one over the same backing (a restart)."""

    def __init__(self, backing: Backing, clock: Clock, settings: Settings, first: SessionStore):
        self._backing = backing
        self._clock = clock
        self._settings = settings
        self.current = first

    async def __call__(self) -> SessionStore:
        await self.current.close()
        self.current = await self._backing.open(clock=self._clock, settings=self._settings)
        return self.current
