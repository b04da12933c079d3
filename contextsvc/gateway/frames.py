"""JSON frames of the WebSocket protocol (docs/websocket.md): protobuf to frames, client frames parsed.

Protobuf messages become plain JSON objects with the proto field names, int64 as numbers (event ids
and sequence numbers stay far below 2^53), enums as short lowercase names (``COMPRESSION_REASON_FORCED``
→ ``"forced"``), timestamps as RFC 3339 strings and image bytes left out.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message as ProtoMessage
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp

from contextsvc._gen.v1 import events_pb2

#: server frame types that carry an event of the service, by the Event payload field.
EVENT_FRAMES = {
    "compression_started",
    "context_compressed",
    "compression_refused",
    "memory_flush_due",
    "messages_appended",
    "baseline_recorded",
    "context_truncated",
    "session_deleted",
}

CLIENT_TYPES = ("auth", "message", "compact", "ping", "get_view", "get_messages", "search", "expand")


def _enum_prefix(enum: EnumDescriptor) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"


def _enum_name(enum: EnumDescriptor, number: int) -> str:
    value = enum.values_by_number.get(number)
    if value is None:
        return str(number)
    name = value.name
    prefix = _enum_prefix(enum)
    return (name[len(prefix) :] if name.startswith(prefix) else name).lower()


def _scalar(fd: Any, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_ENUM and fd.enum_type is not None:
        return _enum_name(fd.enum_type, value)
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return to_json(value)
    return value


def to_json(message: ProtoMessage) -> Any:
    """One protobuf message as a JSON-ready value (see the module docstring)."""
    if isinstance(message, Timestamp):
        return message.ToJsonString() if (message.seconds or message.nanos) else None
    if isinstance(message, Struct):
        return json_format.MessageToDict(message)
    descriptor = message.DESCRIPTOR
    out: dict[str, Any] = {}
    for fd in descriptor.fields:
        if fd.type == FieldDescriptor.TYPE_BYTES:
            continue
        value = getattr(message, fd.name)
        if fd.is_repeated:
            out[fd.name] = [_scalar(fd, v) for v in value]
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            if message.HasField(fd.name):
                out[fd.name] = to_json(value)
        elif fd.has_presence and not message.HasField(fd.name):
            continue
        else:
            out[fd.name] = _scalar(fd, value)
    return out


def event_frame(event: events_pb2.Event) -> dict[str, Any]:
    """An Event as a server frame: ``{"type": <payload kind>, "event_id", "session_id", "time", ...payload}``."""
    kind = event.WhichOneof("payload") or "unknown"
    payload = to_json(getattr(event, kind)) if kind != "unknown" else {}
    return {
        "type": kind,
        "event_id": event.event_id,
        "session_id": event.session_id,
        "time": event.time.ToJsonString() if event.HasField("time") else None,
        **payload,
    }


def dumps(frame: dict[str, Any]) -> str:
    return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)


class FrameError(Exception):
    """A client frame the gateway cannot act on: answered with an ``error`` frame."""

    def __init__(self, code: str, message: str, *, frame_id: Any = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.frame_id = frame_id


def error_frame(code: str, message: str, *, frame_id: Any = None, reason: str = "") -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if reason:
        frame["reason"] = reason
    if frame_id is not None:
        frame["id"] = frame_id
    return frame


def parse(raw: str | bytes) -> dict[str, Any]:
    """A client frame as a dict with a known ``type``; FrameError otherwise."""
    if isinstance(raw, bytes):
        raise FrameError("BAD_FRAME", "binary frames are not accepted; send JSON text frames")
    try:
        frame = json.loads(raw)
    except ValueError as exc:
        raise FrameError("BAD_FRAME", f"not JSON: {exc}") from None
    except RecursionError:
        raise FrameError("BAD_FRAME", f"nested deeper than {MAX_FRAME_DEPTH} levels") from None
    if not isinstance(frame, dict):
        raise FrameError("BAD_FRAME", "a frame must be a JSON object with a type")
    _check_values(frame)
    frame_id = frame.get("id")
    if frame_id is not None and (not isinstance(frame_id, str | int) or isinstance(frame_id, bool)):
        raise FrameError("BAD_FRAME", "id must be a string or an integer")
    kind = frame.get("type")
    if kind not in CLIENT_TYPES:
        raise FrameError(
            "UNKNOWN_TYPE", f"unknown frame type {kind!r}; expected one of {', '.join(CLIENT_TYPES)}", frame_id=frame_id
        )
    return frame


#: How deep a frame's objects and lists may nest (every frame type is at most three levels).
MAX_FRAME_DEPTH = 16


def _check_values(frame: dict[str, Any]) -> None:
    """Refuse what JSON can say but no request may hold: a string with a lone surrogate (``"\\ud800"``
    is valid JSON and no UTF-8), and nesting past ``MAX_FRAME_DEPTH``. Iterative, so a deep frame
    costs no recursion."""
    stack: list[tuple[Any, int]] = [(frame, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise FrameError("BAD_FRAME", "a string holds a lone surrogate: not UTF-8 text") from None
        elif isinstance(value, dict | list):
            if depth > MAX_FRAME_DEPTH:
                raise FrameError("BAD_FRAME", f"nested deeper than {MAX_FRAME_DEPTH} levels")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


@dataclass(slots=True)
class UserMessage:
    """A validated ``message`` frame."""

    content: str
    images: list[bytes] = field(default_factory=list)
    request_id: str = ""
    turn_complete: bool = False


_DATA_URI = re.compile(r"^data:[^,;]*(;[^,]*)?;base64,", re.IGNORECASE)


def parse_message(frame: dict[str, Any], *, max_images: int, max_image_bytes: int, max_files: int) -> UserMessage:
    """Validate a ``message`` frame: content, images (base64 or data URIs) and file references."""
    frame_id = frame.get("id")

    def bad(message: str, code: str = "INVALID_MESSAGE") -> FrameError:
        return FrameError(code, message, frame_id=frame_id)

    content = frame.get("content")
    if not isinstance(content, str) or not content.strip():
        raise bad("content is required and must be a non-empty string")
    images_raw = frame.get("images", [])
    if not isinstance(images_raw, list) or not all(isinstance(i, str) for i in images_raw):
        raise bad("images must be a list of base64 strings or data URIs")
    if len(images_raw) > max_images:
        raise bad(f"at most {max_images} images per message, got {len(images_raw)}", "TOO_MANY_IMAGES")
    # Bound the work before decoding: base64 is 4/3 of the bytes it carries.
    if sum(len(i) for i in images_raw) * 3 // 4 > max_image_bytes + 3 * len(images_raw) + 1024:
        raise bad(f"images exceed {max_image_bytes} bytes in all", "IMAGES_TOO_LARGE")
    images: list[bytes] = []
    for n, text in enumerate(images_raw):
        body = _DATA_URI.sub("", text, count=1)
        try:
            data = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"images[{n}] is not valid base64") from None
        if not data:
            raise bad(f"images[{n}] is empty")
        images.append(data)
    if sum(len(i) for i in images) > max_image_bytes:
        raise bad(f"images exceed {max_image_bytes} bytes in all", "IMAGES_TOO_LARGE")
    files = frame.get("files", [])
    if not isinstance(files, list):
        raise bad("files must be a list of {name, path} objects")
    if len(files) > max_files:
        raise bad(f"at most {max_files} files per message, got {len(files)}")
    refs: list[str] = []
    for n, ref in enumerate(files):
        if (
            not isinstance(ref, dict)
            or not isinstance(ref.get("name", ""), str)
            or not isinstance(ref.get("path"), str)
        ):
            raise bad(f"files[{n}] must be an object with a string path (and optional name)")
        name, path = ref.get("name") or "", ref["path"]
        refs.append(f"{name} ({path})" if name else path)
    if refs:
        content = f"{content}\n\n[Uploaded files on disk: {', '.join(refs)}]"
    request_id = frame.get("request_id", "")
    if not isinstance(request_id, str):
        raise bad("request_id must be a string")
    turn_complete = frame.get("turn_complete", False)
    if not isinstance(turn_complete, bool):
        raise bad("turn_complete must be a boolean")
    return UserMessage(content=content, images=images, request_id=request_id, turn_complete=turn_complete)
