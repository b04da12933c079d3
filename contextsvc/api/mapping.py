"""Protobuf <-> core conversion. The only place (with the servicer) that sees generated types."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format, struct_pb2, timestamp_pb2

from contextsvc._gen.v1 import events_pb2, resources_pb2
from contextsvc.core.messages import DEFAULT_FLAGS, BufferKind, Flags, Message, Role, ToolCall, make_message
from contextsvc.core.profile import NO_OVERRIDES, CompressionOverrides, ProfileOverrides, RecallOverrides
from contextsvc.core.session import SessionInfo
from contextsvc.engine.validation import IncomingImage, IncomingMessage
from contextsvc.errors import FieldViolation, InvalidArgument
from contextsvc.ports import StoredEvent

_ROLE_FROM_PB = {
    resources_pb2.ROLE_SYSTEM: Role.SYSTEM,
    resources_pb2.ROLE_USER: Role.USER,
    resources_pb2.ROLE_ASSISTANT: Role.ASSISTANT,
    resources_pb2.ROLE_TOOL: Role.TOOL,
}
_ROLE_TO_PB = {v: k for k, v in _ROLE_FROM_PB.items()}


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """``value`` as a Timestamp (naive: taken as UTC), as ``Timestamp.FromDatetime`` makes it, by
    one subtraction instead of its pure-Python calendar arithmetic (once per message sent)."""
    if value is None:
        return None
    since = (value if value.tzinfo is not None else value.replace(tzinfo=UTC)) - _EPOCH
    return timestamp_pb2.Timestamp(seconds=since.days * 86_400 + since.seconds, nanos=since.microseconds * 1000)


def struct_to_dict(value: struct_pb2.Struct, field: str = "metadata") -> dict[str, Any]:
    """A Struct as plain JSON; NaN and infinities have no JSON form and are refused."""
    try:
        return json_format.MessageToDict(value)
    except ValueError as exc:
        raise InvalidArgument.field(field, f"is not valid JSON: {exc}") from None


def dict_to_struct(value: Mapping[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    if value:
        out.update(dict(value))
    return out


def buffer_from_pb(value: int) -> BufferKind:
    from contextsvc._gen.v1 import context_service_pb2 as svc

    if value in (svc.BUFFER_UNSPECIFIED, svc.BUFFER_DISPLAY):
        return BufferKind.DISPLAY
    if value == svc.BUFFER_CONTEXT:
        return BufferKind.CONTEXT
    raise InvalidArgument.field("buffer", f"unknown buffer {value}")


def mid_turn_from_pb(value: int) -> bool:
    """Whether a ``BuildContextRequest.phase`` asks for a mid-turn build (unset: pre-turn)."""
    from contextsvc._gen.v1 import context_service_pb2 as svc

    if value in (svc.PHASE_UNSPECIFIED, svc.PHASE_PRE_TURN):
        return False
    if value == svc.PHASE_MID_TURN:
        return True
    raise InvalidArgument.field("phase", f"unknown phase {value}: must be PHASE_PRE_TURN or PHASE_MID_TURN")


def incoming_from_pb(pb: resources_pb2.Message, path: str) -> IncomingMessage:
    """A client's message; output-only fields (sequence number, summary flags...) are ignored."""
    role = _ROLE_FROM_PB.get(pb.role)
    if role is None:
        raise InvalidArgument(
            f"{path}.role: must be one of ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL",
            violations=[FieldViolation(f"{path}.role", f"unknown or unset role {pb.role}")],
        )
    if pb.HasField("flags"):
        f = pb.flags
        flags = Flags(
            is_context=f.is_context if f.HasField("is_context") else True,
            is_display=f.is_display if f.HasField("is_display") else True,
            is_compression_critical=f.is_compression_critical,
            is_plan=f.is_plan,
            is_recall=f.is_recall,
            is_pinned=f.is_pinned,
        )
    else:  # no flags sent (most appends): the defaults, one shared immutable object
        flags = DEFAULT_FLAGS
    # Every field given (``make_message``, set straight into its slot: each appended message is
    # made here, and ``Message(...)``'s generated ``__init__`` costs ~1.5x as much); images
    # are described later, the store numbers and dates the row.
    message = make_message(
        role=role,
        content=pb.content,
        images=(),
        tool_calls=tuple(ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json) for c in pb.tool_calls)
        if pb.tool_calls
        else (),
        tool_call_id=pb.tool_call_id,
        name=pb.name,
        thinking=pb.thinking,
        flags=flags,
        metadata=struct_to_dict(pb.metadata, f"{path}.metadata") if pb.HasField("metadata") else {},
        sequence_number=0,
        create_time=None,
        token_count=0,
        replaces=None,
        context_anchor=0,
    )
    if not pb.images:
        return IncomingMessage(message=message)
    images = tuple(IncomingImage(data=i.data, blob_id=i.blob_id) for i in pb.images)
    return IncomingMessage(message=message, images=images)


def profile_from_pb(pb: resources_pb2.Profile | None) -> ProfileOverrides:
    if pb is None:
        return NO_OVERRIDES
    c = pb.compression
    r = pb.recall

    def opt(msg: Any, name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else None

    return ProfileOverrides(
        profile_id=pb.profile_id,
        model=opt(pb, "model"),
        context_window=opt(pb, "context_window"),
        system_prompt=opt(pb, "system_prompt"),
        vision=opt(pb, "vision"),
        output_reserve_tokens=opt(pb, "output_reserve_tokens"),
        message_token_budget=opt(pb, "message_token_budget"),
        compression=CompressionOverrides(
            enabled=opt(c, "enabled"),
            threshold=opt(c, "threshold"),
            target=opt(c, "target"),
            keep_recent=opt(c, "keep_recent"),
            summary_max_tokens=opt(c, "summary_max_tokens"),
            summary_prompt=opt(c, "summary_prompt"),
            summarizer=opt(c, "summarizer"),
            strategies=tuple(c.strategies),
            critical_tool_names=tuple(c.critical_tool_names),
            hard_truncate_fallback=opt(c, "hard_truncate_fallback"),
        ),
        recall=RecallOverrides(
            enabled=opt(r, "enabled"),
            max_excerpts=opt(r, "max_excerpts"),
            max_tokens=opt(r, "max_tokens"),
            min_score=opt(r, "min_score"),
        ),
    )


def session_to_pb(s: SessionInfo) -> resources_pb2.Session:
    return resources_pb2.Session(
        id=s.id,
        profile_id=s.profile_id,
        user_id=s.user_id,
        name=s.name,
        pinned=s.pinned,
        create_time=timestamp(s.create_time),
        update_time=timestamp(s.update_time),
        context_tokens=s.context_tokens,
        display_message_count=s.display_message_count,
        metadata=dict_to_struct(s.metadata),
        context_message_count=s.context_message_count,
        context_truncated=s.context_truncated,
        preview=s.preview,
    )


def message_to_pb(m: Message, *, truncated_in_view: bool = False) -> resources_pb2.Message:
    pb = resources_pb2.Message(
        sequence_number=m.sequence_number,
        role=_ROLE_TO_PB[m.role],
        content=m.content,
        flags=_flags_to_pb(m.flags),
        create_time=timestamp(m.create_time),
        token_count=m.token_count,
        truncated_in_view=truncated_in_view,
    )
    # Only the fields a row has: each set costs (every new row is encoded once).
    if m.images:
        pb.images.extend(
            resources_pb2.Image(
                blob_id=i.blob_id,
                mime_type=i.mime_type,
                width=i.width,
                height=i.height,
                token_count=i.token_count,
            )
            for i in m.images
        )
    if m.tool_calls:
        pb.tool_calls.extend(
            resources_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json) for c in m.tool_calls
        )
    if m.tool_call_id:
        pb.tool_call_id = m.tool_call_id
    if m.name:
        pb.name = m.name
    if m.thinking:
        pb.thinking = m.thinking
    if m.metadata:
        pb.metadata.CopyFrom(dict_to_struct(m.metadata))
    if m.replaces is not None:
        pb.replaces.CopyFrom(resources_pb2.SequenceRange(first=m.replaces[0], last=m.replaces[1]))
    return pb


@functools.lru_cache(maxsize=256)
def _flags_to_pb(f: Flags) -> resources_pb2.MessageFlags:
    """A row's flags on the wire, made once per combination (a handful occur); copied into each
    message that carries them, never changed."""
    return resources_pb2.MessageFlags(
        is_context=f.is_context,
        is_display=f.is_display,
        is_summary=f.is_summary,
        is_compression=f.is_compression,
        is_compression_critical=f.is_compression_critical,
        is_plan=f.is_plan,
        is_recall=f.is_recall,
        is_pinned=f.is_pinned,
    )


def event_to_pb(e: StoredEvent) -> events_pb2.Event:
    pb = events_pb2.Event(event_id=e.event_id, session_id=e.session_id, time=timestamp(e.time))
    payload = dict(e.payload)
    if e.kind == "messages_appended":
        pb.messages_appended.CopyFrom(
            events_pb2.MessagesAppended(
                sequence_numbers=payload.get("sequence_numbers", []),
                context_tokens=payload.get("context_tokens", 0),
                request_id=payload.get("request_id", ""),
                turn_complete=payload.get("turn_complete", False),
            )
        )
    elif e.kind == "session_deleted":
        pb.session_deleted.CopyFrom(
            events_pb2.SessionDeleted(reason=str(payload.get("reason", "")), detail=str(payload.get("detail", "")))
        )
    else:
        _extended_event(pb, e.kind, payload)
    return pb


def _extended_event(pb: events_pb2.Event, kind: str, payload: dict[str, Any]) -> None:
    """Events whose payload maps one-to-one onto the protobuf message of the same name."""
    target = {
        "compression_started": pb.compression_started,
        "context_compressed": pb.context_compressed,
        "baseline_recorded": pb.baseline_recorded,
        "context_truncated": pb.context_truncated,
        "memory_flush_due": pb.memory_flush_due,
        "compression_refused": pb.compression_refused,
    }.get(kind)
    if target is None:
        raise ValueError(f"unknown event kind {kind!r}")
    # The engine names reasons and methods in lower case ("preturn", "hard_truncate").
    converted = dict(payload)
    for key, prefix in (
        ("reason", "COMPRESSION_REASON_"),
        ("trigger", "COMPRESSION_REASON_"),
        ("method", "COMPRESSION_METHOD_"),
    ):
        if isinstance(converted.get(key), str):
            converted[key] = prefix + converted[key].upper()
    if isinstance(converted.get("stages"), list):
        converted["stages"] = [
            {**stage, "method": "COMPRESSION_METHOD_" + str(stage.get("method", "unspecified")).upper()}
            for stage in converted["stages"]
            if isinstance(stage, dict)
        ]
    json_format.ParseDict(converted, target, ignore_unknown_fields=True)
