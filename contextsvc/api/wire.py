"""The BuildContext response written from pre-encoded message bytes (issue #15, items 1 and 3).

A repeated protobuf field on the wire is the concatenation of its elements, each framed as a
field tag, a varint length and the element's own encoding, and a message's fields may come in
any order. So a response is the encoding of its few fresh fields (view id, estimate, notices,
compression report) followed by one framed element per view message, and a stored message
is encoded once, when it is first sent, not at every build: the bytes stay in ``WireCache``.

What the cache keys on: a stored row is immutable except for its flags (``set_context_flag``
and compactions rewrite those), so ``(session id, sequence number)`` names it and the flags,
token count and content length are checked on every hit; a mismatch re-encodes. A message the
view changed (cut to the per-message budget, images left out or carried with their bytes) is
encoded fresh and never cached. Memory is bounded by ``Settings.wire_cache_mb`` (LRU, counted
in encoded bytes plus a fixed per-entry allowance); ``stats()`` reports what it holds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc.api.mapping import message_to_pb
from contextsvc.api.views import response_fields
from contextsvc.core.messages import Flags, Message
from contextsvc.engine.views import BuiltView, ViewMessage

__all__ = ["EncodedResponse", "WireCache", "encode_build_response", "frame", "serialize"]

#: Tag of ``BuildContextResponse.messages`` (field 1, wire type 2: length-delimited).
_MESSAGES_TAG = bytes([(pb.BuildContextResponse.MESSAGES_FIELD_NUMBER << 3) | 2])
#: Tag of ``BuildContextResponse.view_id`` (field 2, length-delimited).
_VIEW_ID_TAG = bytes([(pb.BuildContextResponse.VIEW_ID_FIELD_NUMBER << 3) | 2])
#: What one cache entry costs beyond its bytes (key tuple, OrderedDict node, the entry object).
ENTRY_OVERHEAD_BYTES = 200


class EncodedResponse:
    """A response already in wire form; ``serialize`` hands its bytes to gRPC untouched (gRPC's
    runtime wants exactly ``bytes``, not a subclass)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def serialize(response: object) -> bytes:
    """The response serializer of methods that may answer with ``EncodedResponse``."""
    if isinstance(response, EncodedResponse):
        return response.data
    return response.SerializeToString()  # type: ignore[attr-defined, no-any-return]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame(encoded: bytes) -> bytes:
    """One element of ``BuildContextResponse.messages``: tag + length + the message's bytes."""
    return _MESSAGES_TAG + _varint(len(encoded)) + encoded


@dataclass(slots=True, frozen=True)
class _Entry:
    flags: Flags
    token_count: int
    content_len: int
    framed: bytes


@dataclass(slots=True)
class _ViewEntry:
    """The framed messages of a session's last view, valid while the engine hands out the very
    same message list (it does when it reuses the view: ``engine.view_memo``). Holding the list
    keeps its identity from being reused. ``rest`` is the encoding of the response's other fields
    but the view id, valid for the very ``estimate`` object and these ``notices`` (a reused view
    hands out the same estimate; no compression report)."""

    messages: list[ViewMessage]
    framed: bytes
    estimate: object = None
    notices: tuple[str, ...] = ()
    rest: bytes | None = None


#: Key slot of a session's whole-view entry (no stored row has sequence number 0).
_VIEW = 0


class WireCache:
    """LRU of framed, encoded stored messages, bounded in bytes. Safe to share across tasks and
    threads (one lock around the dict operations; encoding happens outside it)."""

    __slots__ = ("_bytes", "_entries", "_lock", "_max_bytes", "hits", "misses")

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, int], _Entry | _ViewEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def framed(self, session_id: str, m: Message) -> bytes:
        """The framed wire form of stored message ``m`` (encoded on a miss, then kept)."""
        key = (session_id, m.sequence_number)
        with self._lock:
            entry = self._entries.get(key)
            if (
                isinstance(entry, _Entry)
                and entry.flags == m.flags
                and entry.token_count == m.token_count
                and entry.content_len == len(m.content)
            ):
                self._entries.move_to_end(key)
                self.hits += 1
                return entry.framed
        self.misses += 1
        framed = frame(message_to_pb(m).SerializeToString())
        self._put(key, _Entry(m.flags, m.token_count, len(m.content), framed))
        return framed

    def view(self, session_id: str, messages: list[ViewMessage]) -> _ViewEntry | None:
        """The entry of ``messages`` when they are the session's last view's, else None."""
        key = (session_id, _VIEW)
        with self._lock:
            entry = self._entries.get(key)
            if isinstance(entry, _ViewEntry) and entry.messages is messages:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
        return None

    def put_view(self, session_id: str, messages: list[ViewMessage], framed: bytes) -> _ViewEntry:
        entry = _ViewEntry(messages, framed)
        self._put((session_id, _VIEW), entry)
        return entry

    def _put(self, key: tuple[str, int], entry: _Entry | _ViewEntry) -> None:
        cost = len(entry.framed) + ENTRY_OVERHEAD_BYTES
        if cost > self._max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old.framed) + ENTRY_OVERHEAD_BYTES
            while self._entries and self._bytes + cost > self._max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.framed) + ENTRY_OVERHEAD_BYTES
            self._entries[key] = entry
            self._bytes += cost

    def forget_session(self, session_id: str) -> None:
        """Drop a session's entries (after it is deleted): memory back at once, not by aging out."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == session_id]:
                self._bytes -= len(self._entries.pop(key).framed) + ENTRY_OVERHEAD_BYTES

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "max_bytes": self._max_bytes,
                "hits": self.hits,
                "misses": self.misses,
            }


def _fresh(vm: ViewMessage) -> bytes:
    m = message_to_pb(vm.message, truncated_in_view=vm.truncated)
    for image, data in zip(m.images, vm.image_data, strict=True):
        image.data = data
    return frame(m.SerializeToString())


def _view_id_field(view_id: str) -> bytes:
    if not view_id:
        return b""
    raw = view_id.encode()
    return _VIEW_ID_TAG + _varint(len(raw)) + raw


def _tail(built: BuiltView, entry: _ViewEntry | None) -> bytes:
    """Every field but ``messages``: the view id, then the rest, kept with the view's entry while
    the estimate object and the notices are the same (a build that reuses the view)."""
    if entry is None or built.compression is not None:
        return response_fields(built).SerializeToString()
    notices = tuple(built.notices)
    if entry.rest is None or entry.estimate is not built.estimate or entry.notices != notices:
        rest = response_fields(dataclasses.replace(built, view_id="")).SerializeToString()
        entry.estimate, entry.notices, entry.rest = built.estimate, notices, rest
    return _view_id_field(built.view_id) + entry.rest


def encode_build_response(
    built: BuiltView, session_id: str, cache: WireCache, tail: pb.BuildContextResponse | None = None
) -> EncodedResponse:
    """``built`` on the wire: each view message framed (from ``cache`` when it is a stored row the
    view did not change), then the response's other fields: ``tail`` when given (without
    messages), else encoded here (kept with the view's entry for builds that reuse it)."""
    whole = cache.view(session_id, built.messages)
    if whole is not None:
        tail_bytes = tail.SerializeToString() if tail is not None else _tail(built, whole)
        return EncodedResponse(whole.framed + tail_bytes)
    parts: list[bytes] = []
    carries_images = False
    for vm in built.messages:
        m = vm.message
        if vm.truncated or m.images or not m.sequence_number or not vm.stored:
            carries_images = carries_images or bool(vm.image_data)
            parts.append(_fresh(vm))
        else:
            parts.append(cache.framed(session_id, m))
    framed = b"".join(parts)
    entry = None if carries_images else cache.put_view(session_id, built.messages, framed)
    tail_bytes = tail.SerializeToString() if tail is not None else _tail(built, entry)
    return EncodedResponse(framed + tail_bytes)
