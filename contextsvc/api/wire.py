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
encoded fresh and never cached. Memory is bounded by ``hot_path.wire_cache_mb`` (LRU, counted
in encoded bytes plus a fixed per-entry allowance); ``stats()`` reports what it holds.
"""

from __future__ import annotations

import operator
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc.api.mapping import message_to_pb
from contextsvc.api.views import response_fields
from contextsvc.core.messages import Flags, Message
from contextsvc.engine.views import BuiltView, ViewMessage

__all__ = ["EncodedResponse", "WireCache", "encode_build_response", "frame", "length_delimited", "serialize"]

#: Tag of ``BuildContextResponse.messages`` (field 1, wire type 2: length-delimited).
_MESSAGES_TAG = bytes([(pb.BuildContextResponse.MESSAGES_FIELD_NUMBER << 3) | 2])
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


def length_delimited(field_number: int, encoded: bytes) -> bytes:
    """A length-delimited field (a message, bytes, a string) on the wire: tag, length, ``encoded``."""
    return _varint(field_number << 3 | 2) + _varint(len(encoded)) + encoded


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
    #: the messages' part of the response it was encoded for (a view of that response's bytes:
    #: the response is written in one copy, and the next view's prefix read from it)
    framed: bytes | memoryview
    #: where each message's bytes end in ``framed`` (so a run of the messages can be copied alone)
    ends: array[int] = field(default_factory=lambda: array("q"))
    estimate: object = None
    notices: tuple[str, ...] = ()
    rest: bytes | None = None


class _Session:
    """One session's entries: its stored rows' encodings (least recently used first) and its last
    view's, and what they cost."""

    __slots__ = ("bytes", "rows", "view")

    def __init__(self) -> None:
        self.rows: OrderedDict[int, _Entry] = OrderedDict()
        self.view: _ViewEntry | None = None
        self.bytes = 0


def _cost(entry: _Entry | _ViewEntry) -> int:
    ends = entry.ends.itemsize * len(entry.ends) if isinstance(entry, _ViewEntry) else 0
    return len(entry.framed) + ends + ENTRY_OVERHEAD_BYTES


class WireCache:
    """LRU of framed, encoded stored messages, bounded in bytes, grouped by session: the least
    recently used session's entries go first (within the one session in use, its oldest rows).
    Safe to share across tasks and threads (one lock around the dict operations; encoding
    happens outside it).

    ``on_size(session_id, nbytes)`` (optional) is told what a session's entries cost after each
    response encoded for it, and 0 when the cache drops them to stay within its own bound: the
    files store counts it under its one memory budget (``files.cache_mb``) and, when it lets the
    session go, drops the entries with ``forget_session``.
    """

    __slots__ = ("_bytes", "_lock", "_max_bytes", "_sessions", "hits", "misses", "on_size")

    def __init__(self, max_bytes: int, on_size: Callable[[str, int], None] | None = None) -> None:
        self._max_bytes = max_bytes
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.on_size = on_size

    def framed(self, session_id: str, m: Message) -> bytes:
        """The framed wire form of stored message ``m`` (encoded on a miss, then kept)."""
        dropped: list[str] = []
        try:
            return self._framed(session_id, m, dropped)
        finally:
            self._tell_dropped(dropped)

    def _framed(self, session_id: str, m: Message, dropped: list[str]) -> bytes:
        seq = m.sequence_number
        with self._lock:
            held = self._sessions.get(session_id)
            entry = held.rows.get(seq) if held is not None else None
            if (
                held is not None
                and entry is not None
                and entry.flags == m.flags
                and entry.token_count == m.token_count
                and entry.content_len == len(m.content)
            ):
                held.rows.move_to_end(seq)
                self._sessions.move_to_end(session_id)
                self.hits += 1
                return entry.framed
        self.misses += 1
        framed = frame(message_to_pb(m).SerializeToString())
        self._put(session_id, seq, _Entry(m.flags, m.token_count, len(m.content), framed), dropped)
        return framed

    def view(self, session_id: str, messages: list[ViewMessage]) -> _ViewEntry | None:
        """The entry of ``messages`` when they are the session's last view's, else None."""
        with self._lock:
            held = self._sessions.get(session_id)
            entry = held.view if held is not None else None
            if entry is not None and entry.messages is messages:
                self._sessions.move_to_end(session_id)
                self.hits += 1
                return entry
        return None

    def view_prefix(
        self, session_id: str, messages: list[ViewMessage], extends: list[ViewMessage] | None = None
    ) -> _ViewEntry | None:
        """The session's last view's entry when its messages are the first ones of ``messages``
        (the very same objects: a view extended by the rows appended since), else None.
        ``extends``: the messages of the view ``messages`` was made from by appending, when known;
        the entry of that very list needs no comparison of its rows."""
        with self._lock:
            held = self._sessions.get(session_id)
            entry = held.view if held is not None else None
        if entry is None or len(entry.messages) > len(messages) or not entry.messages:
            return None
        known = entry.messages is extends and messages[len(extends) - 1] is extends[-1]
        if not known and not all(map(operator.is_, entry.messages, messages)):
            return None
        self.hits += 1
        return entry

    def last_view(self, session_id: str) -> _ViewEntry | None:
        """The entry of the session's last view encoded, whatever its messages."""
        with self._lock:
            held = self._sessions.get(session_id)
            return held.view if held is not None else None

    def put_view(self, session_id: str, entry: _ViewEntry) -> _ViewEntry:
        dropped: list[str] = []
        self._put(session_id, None, entry, dropped)
        self._tell_dropped(dropped)
        return entry

    def _put(self, session_id: str, seq: int | None, entry: _Entry | _ViewEntry, dropped: list[str]) -> None:
        cost = _cost(entry)
        if cost > self._max_bytes:
            return
        with self._lock:
            held = self._sessions.get(session_id)
            if held is None:
                held = self._sessions[session_id] = _Session()
            self._sessions.move_to_end(session_id)
            old = held.view if seq is None else held.rows.pop(seq, None)
            if old is not None:
                held.bytes -= _cost(old)
                self._bytes -= _cost(old)
                if seq is None:
                    held.view = None
            while self._bytes + cost > self._max_bytes and self._drop_oldest(session_id, dropped):
                pass
            if isinstance(entry, _ViewEntry):
                held.view = entry
            elif seq is not None:
                held.rows[seq] = entry
            held.bytes += cost
            self._bytes += cost

    def _drop_oldest(self, keep: str, dropped: list[str]) -> bool:
        """Drop the least recently used session other than ``keep``; else ``keep``'s oldest row,
        then its view. False when nothing is left to drop (under the lock)."""
        for sid in self._sessions:
            if sid != keep:
                self._bytes -= self._sessions.pop(sid).bytes
                dropped.append(sid)
                return True
        held = self._sessions.get(keep)
        if held is None:
            return False
        if held.rows:
            cost = _cost(held.rows.popitem(last=False)[1])
        elif held.view is not None:
            cost, held.view = _cost(held.view), None
        else:
            return False
        held.bytes -= cost
        self._bytes -= cost
        return True

    def _tell_dropped(self, dropped: list[str]) -> None:
        if self.on_size is not None:
            for sid in dropped:
                self.on_size(sid, 0)

    def session_bytes(self, session_id: str) -> int:
        """What the session's entries cost now (their encodings and ``ENTRY_OVERHEAD_BYTES`` each)."""
        with self._lock:
            held = self._sessions.get(session_id)
            return held.bytes if held is not None else 0

    def told(self, session_id: str) -> None:
        """Tell ``on_size`` what the session's entries cost now (after a response was encoded)."""
        if self.on_size is not None:
            self.on_size(session_id, self.session_bytes(session_id))

    def forget_session(self, session_id: str) -> None:
        """Drop a session's entries (deleted, or let go by the store): memory back at once, not by
        aging out. ``on_size`` is not told (whoever asked knows)."""
        with self._lock:
            held = self._sessions.pop(session_id, None)
            if held is not None:
                self._bytes -= held.bytes

    def holds(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": sum(len(s.rows) + (s.view is not None) for s in self._sessions.values()),
                "sessions": len(self._sessions),
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
    return length_delimited(pb.BuildContextResponse.VIEW_ID_FIELD_NUMBER, view_id.encode())


def _tail(built: BuiltView, entry: _ViewEntry | None) -> bytes:
    """Every field but ``messages``: the view id, then the rest, kept with the view's entry while
    the estimate object and the notices are the same (a build that reuses the view)."""
    if entry is None or built.compression is not None:
        return response_fields(built).SerializeToString()
    notices = tuple(built.notices)
    if entry.rest is None or entry.estimate is not built.estimate or entry.notices != notices:
        rest = response_fields(built, with_view_id=False).SerializeToString()
        entry.estimate, entry.notices, entry.rest = built.estimate, notices, rest
    return _view_id_field(built.view_id) + entry.rest


def _framed_row(cache: WireCache, session_id: str, vm: ViewMessage) -> bytes:
    """One view message framed: a stored row the view did not change from ``cache``, else fresh."""
    m = vm.message
    if vm.truncated or m.images or not m.sequence_number or not vm.stored:
        return _fresh(vm)
    return cache.framed(session_id, m)


def _spliced(
    cache: WireCache,
    session_id: str,
    messages: list[ViewMessage],
    extends: list[ViewMessage] | None,
    parts: list[bytes | memoryview],
) -> tuple[array[int], bool]:
    """``messages`` framed onto ``parts``, each run of rows the session's last view holds at the
    same places (the very same objects) copied from its bytes, the others framed one by one; the
    row ends, and whether a row carries image bytes. A view extended by rows appended since the
    last one (``engine.views``' ``_extended``: ``extends``) is one run and the new rows, known
    without comparing its rows; a view one of whose cut rows was cut again by a new calibration, two runs and it."""
    held = cache.view_prefix(session_id, messages, extends)
    if held is not None:
        same = [True] * len(held.messages)
    else:
        held = cache.last_view(session_id)
        same = list(map(operator.is_, held.messages, messages)) if held is not None else []
    ends = array("q")
    carries_images = False
    pos = 0
    i = 0
    while i < len(messages):
        if i < len(same) and same[i]:
            assert held is not None
            try:
                j = same.index(False, i)
            except ValueError:
                j = len(same)
            base = held.ends[i - 1] if i else 0
            parts.append(held.framed[base : held.ends[j - 1]])
            if pos == base:  # a run from the view's start (an extended view): copied as they are
                ends.extend(held.ends[i:j])
            else:  # the same bytes, now at ``pos``
                ends.extend(map((pos - base).__add__, held.ends[i:j]))
            pos = ends[-1]
            i = j
            continue
        vm = messages[i]
        carries_images = carries_images or bool(vm.image_data)
        framed = _framed_row(cache, session_id, vm)
        parts.append(framed)
        pos += len(framed)
        ends.append(pos)
        i += 1
    return ends, carries_images


def encode_build_response(
    built: BuiltView, session_id: str, cache: WireCache, tail: pb.BuildContextResponse | None = None
) -> EncodedResponse:
    """``built`` on the wire: each view message framed (from ``cache`` when it is a stored row the
    view did not change), then the response's other fields: ``tail`` when given (without
    messages), else encoded here (kept with the view's entry for builds that reuse it)."""
    whole = cache.view(session_id, built.messages)
    if whole is not None:
        tail_bytes = tail.SerializeToString() if tail is not None else _tail(built, whole)
        return EncodedResponse(b"".join((whole.framed, tail_bytes)))
    parts: list[bytes | memoryview] = []
    ends, carries_images = _spliced(cache, session_id, built.messages, built.extends, parts)
    entry = None if carries_images else _ViewEntry(built.messages, b"")
    tail_bytes = tail.SerializeToString() if tail is not None else _tail(built, entry)
    # One copy of the view's bytes (they are the most of a response): the response is joined
    # whole, and the entry keeps its messages' part as a view of it.
    parts.append(tail_bytes)
    data = b"".join(parts)
    if entry is not None:
        entry.framed = memoryview(data)[: len(data) - len(tail_bytes)]
        entry.ends = ends
        cache.put_view(session_id, entry)
    cache.told(session_id)
    return EncodedResponse(data)
