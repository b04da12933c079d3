"""Request limits and shape rules. Violations name the field as the API spells it."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contextsvc.config import Limits
from contextsvc.core.messages import Message, Role
from contextsvc.errors import FieldViolation, InvalidArgument, quoted


@dataclass(slots=True, frozen=True)
class IncomingImage:
    """An image as a client sent it: new bytes, or a reference to an already stored blob."""

    data: bytes = b""
    blob_id: str = ""


@dataclass(slots=True, frozen=True)
class IncomingMessage:
    """A message to append: the core message (no images yet) and its images as sent."""

    message: Message
    images: tuple[IncomingImage, ...] = ()


#: A UUID already in the form ``str(uuid.UUID(...))`` gives back (every id this service hands out).
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def require_session_id(session_id: str, field: str = "session_id") -> str:
    """``session_id`` as a canonical UUID (lowercase, hyphenated); any form ``uuid.UUID`` reads
    is accepted (upper case, braces, a ``urn:uuid:`` prefix, no hyphens)."""
    if not session_id:
        raise InvalidArgument.field(field, "is required")
    if _CANONICAL_UUID.fullmatch(session_id):
        return session_id  # what the parse below would give back
    try:
        return str(uuid.UUID(session_id))
    except ValueError:
        raise InvalidArgument.field(field, "must be a UUID") from None


def metadata_size(metadata: Mapping[str, Any]) -> int:
    return len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode())


#: ``metadata_size({})``.
_EMPTY_METADATA_BYTES = 2


def metadata_depth(value: Any) -> int:
    """Levels of nested objects and lists: ``{}`` is 1, ``{"a": {"b": 1}}`` is 2. Iterative, so a
    hostile value cannot exhaust the stack."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _depth_violation(metadata: Mapping[str, Any], limits: Limits, field: str) -> FieldViolation | None:
    depth = metadata_depth(metadata)
    if depth > limits.max_metadata_depth:
        return FieldViolation(field, f"is nested {depth} levels deep; the limit is {limits.max_metadata_depth}")
    return None


def check_metadata(metadata: Mapping[str, Any], limits: Limits, field: str) -> None:
    if "\\u0000" in json.dumps(metadata):
        raise InvalidArgument.field(field, "contains a NUL character")
    too_deep = _depth_violation(metadata, limits, field)
    if too_deep is not None:
        raise InvalidArgument(f"{field}: {too_deep.description}", violations=[too_deep])
    size = metadata_size(metadata)
    if size > limits.max_metadata_bytes:
        raise InvalidArgument.field(field, f"is {size} bytes; the limit is {limits.max_metadata_bytes}")


def check_no_nul(text: str, field: str) -> None:
    """NUL is no text character, and PostgreSQL cannot store it: refused on every store alike."""
    if "\x00" in text:
        raise InvalidArgument.field(field, "contains a NUL character")


def check_name(name: str, limits: Limits, field: str) -> None:
    check_no_nul(name, field)
    if len(name) > limits.max_name_chars:
        raise InvalidArgument.field(field, f"is {len(name)} characters; the limit is {limits.max_name_chars}")


def check_page_size(page_size: int, limits: Limits, field: str = "page_size") -> int:
    """AIP-158: 0 means the default, above the maximum is clamped, negative is an error."""
    if page_size < 0:
        raise InvalidArgument.field(field, "must not be negative")
    if page_size == 0:
        return limits.default_page_size
    return min(page_size, limits.max_page_size)


def check_messages(
    messages: Sequence[IncomingMessage], limits: Limits, field: str = "messages", *, repeated: bool = True
) -> None:
    """Every violation of an append at once, so a client fixes them in one round trip.
    ``repeated`` False: ``field`` is one message (``incoming``), named without an index."""
    violations: list[FieldViolation] = []
    if not messages:
        violations.append(FieldViolation(field, "at least one message is required"))
    if len(messages) > limits.max_messages_per_append:
        violations.append(
            FieldViolation(field, f"{len(messages)} messages; the limit is {limits.max_messages_per_append} per call")
        )
    image_bytes = 0
    for i, incoming in enumerate(messages):
        path = f"{field}[{i}]" if repeated else field
        m = incoming.message
        violations.extend(_message_violations(m, incoming.images, limits, path))
        image_bytes += sum(len(img.data) for img in incoming.images)
    if image_bytes > limits.max_image_bytes_per_append:
        violations.append(
            FieldViolation(
                field, f"images total {image_bytes} bytes; the limit is {limits.max_image_bytes_per_append} per call"
            )
        )
    if violations:
        first = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise InvalidArgument(f"{first.field}: {first.description}{more}", violations=violations)


# NUL is no text character, and PostgreSQL cannot store it in text or jsonb: refused for every store
# alike, so a session never depends on which store it was written to.
_NUL = "\x00"


def _nul_violations(m: Message, path: str) -> list[FieldViolation]:
    out = [FieldViolation(f"{path}.{name}", "contains a NUL character") for name, v in _text_fields(m) if _NUL in v]
    if m.metadata and "\\u0000" in json.dumps(m.metadata):
        out.append(FieldViolation(f"{path}.metadata", "contains a NUL character"))
    return out


def _text_fields(m: Message) -> Iterator[tuple[str, str]]:
    """(field name, text) of each text field of ``m``; the names of tool-call fields are made only
    for messages that have tool calls (an append checks every message)."""
    yield "content", m.content
    yield "thinking", m.thinking
    yield "name", m.name
    yield "tool_call_id", m.tool_call_id
    for j, call in enumerate(m.tool_calls):
        yield f"tool_calls[{j}].id", call.id
        yield f"tool_calls[{j}].name", call.name
        yield f"tool_calls[{j}].arguments_json", call.arguments_json


def _message_violations(m: Message, images: Sequence[IncomingImage], limits: Limits, path: str) -> list[FieldViolation]:
    out: list[FieldViolation] = _nul_violations(m, path)
    if len(m.content) > limits.max_content_chars:
        out.append(
            FieldViolation(
                f"{path}.content", f"is {len(m.content)} characters; the limit is {limits.max_content_chars}"
            )
        )
    if len(m.thinking) > limits.max_content_chars:
        out.append(
            FieldViolation(
                f"{path}.thinking", f"is {len(m.thinking)} characters; the limit is {limits.max_content_chars}"
            )
        )
    if len(images) > limits.max_images_per_message:
        out.append(
            FieldViolation(f"{path}.images", f"{len(images)} images; the limit is {limits.max_images_per_message}")
        )
    for j, img in enumerate(images):
        if bool(img.data) == bool(img.blob_id):
            out.append(FieldViolation(f"{path}.images[{j}]", "set exactly one of data or blob_id"))
    if len(m.tool_calls) > limits.max_tool_calls_per_message:
        out.append(
            FieldViolation(
                f"{path}.tool_calls", f"{len(m.tool_calls)} calls; the limit is {limits.max_tool_calls_per_message}"
            )
        )
    if m.tool_calls and m.role is not Role.ASSISTANT:
        out.append(FieldViolation(f"{path}.tool_calls", "only assistant messages carry tool calls"))
    seen: set[str] = set()
    for j, call in enumerate(m.tool_calls):
        if not call.id:
            out.append(FieldViolation(f"{path}.tool_calls[{j}].id", "is required"))
        elif call.id in seen:
            out.append(FieldViolation(f"{path}.tool_calls[{j}].id", f"duplicate id {quoted(call.id)}"))
        seen.add(call.id)
        if not call.name:
            out.append(FieldViolation(f"{path}.tool_calls[{j}].name", "is required"))
        if call.arguments_json:
            try:
                json.loads(call.arguments_json)
            except ValueError:
                out.append(FieldViolation(f"{path}.tool_calls[{j}].arguments_json", "is not valid JSON"))
    if m.role is Role.TOOL and not m.tool_call_id:
        out.append(FieldViolation(f"{path}.tool_call_id", "is required for a tool result"))
    if m.role is not Role.TOOL and m.tool_call_id:
        out.append(FieldViolation(f"{path}.tool_call_id", "only tool results carry a tool_call_id"))
    if not m.flags.is_context and not m.flags.is_display:
        out.append(FieldViolation(f"{path}.flags", "a message must be in at least one buffer"))
    # No metadata (most messages): ``{}`` is 2 bytes and 1 level deep (the depth limit is >= 1),
    # no need to encode or walk it.
    size = metadata_size(m.metadata) if m.metadata else _EMPTY_METADATA_BYTES
    if size > limits.max_metadata_bytes:
        out.append(FieldViolation(f"{path}.metadata", f"exceeds {limits.max_metadata_bytes} bytes"))
    too_deep = _depth_violation(m.metadata, limits, f"{path}.metadata") if m.metadata else None
    if too_deep is not None:
        out.append(too_deep)
    if len(m.name) > limits.max_name_chars:
        out.append(FieldViolation(f"{path}.name", f"exceeds {limits.max_name_chars} characters"))
    return out
