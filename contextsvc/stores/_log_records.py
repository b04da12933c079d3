"""A files-store log's lines: records to checked JSON lines and back, and a log's lines replayed
into its session (``scan_log``, shared with ``contextsvc fsck``). Pure: no I/O; the store
(``files.py``) reads and writes the bytes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from contextsvc.core.codec import message_from_dict, message_to_dict, session_from_dict, session_to_dict
from contextsvc.core.priors import current_cuts, current_features
from contextsvc.core.session import SessionInfo
from contextsvc.ports import HistoryChunk, ViewRecord
from contextsvc.stores._frames import BadFrame, frame, unframe
from contextsvc.stores._session import (
    ROW_BYTES,
    AppendRecord,
    CompactionRecord,
    FlagsRecord,
    HeaderRecord,
    Record,
    RecordError,
    SaveViewRecord,
    SessionState,
    StateRecord,
)

#: The log format a session's header line names (a log of another format is not read).
FORMAT = 1

# -- scanning a log -------------------------------------------------------------------------------


@dataclass(slots=True)
class FsckEntry:
    """One session's line in the ``contextsvc fsck`` report."""

    session_id: str
    #: ok | torn | recovered | damaged | unreadable
    outcome: str
    detail: str
    #: what ``--repair`` did ("" when nothing was done).
    repaired: str = ""


@dataclass(slots=True)
class LogScan:
    """What a log holds, and what is wrong with it (``scan_log``)."""

    st: SessionState | None
    #: (line number, what is wrong) for every line set aside.
    bad: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    #: sequence numbers acknowledged but unreadable (stand-ins were put in their place).
    lost: list[int] = dataclasses.field(default_factory=list)
    #: how many of ``lost`` are the log's end lost unsynced in batch durability (``scan_log``).
    unsynced: int = 0
    #: only the last line is bad: an interrupted write, when nothing acknowledged is lost.
    torn_tail: bool = False
    header_lost: bool = False
    overhead: int = 0

    @property
    def outcome(self) -> str:
        """``ok``; ``torn`` (an interrupted write dropped, nothing acknowledged lost);
        ``recovered`` (bad records set aside, no message lost); ``damaged`` (read-only)."""
        if self.st is not None and self.st.damage:
            return "damaged"
        if self.bad:
            return "torn" if self.torn_tail and not self.lost else "recovered"
        return "recovered" if self.lost else "ok"

    def describe(self) -> str:
        if self.outcome == "torn":
            return f"torn last line {self.bad[0][0]} dropped (an interrupted write, never acknowledged)"
        parts = []
        if self.header_lost:
            parts.append("header lost (rebuilt from the mark file and the first records)")
        if self.bad:
            shown = ", ".join(f"line {n} ({what})" for n, what in self.bad[:5])
            more = f" and {len(self.bad) - 5} more" if len(self.bad) > 5 else ""
            parts.append(f"{len(self.bad)} unreadable record(s) set aside: {shown}{more}")
        if self.lost:
            parts.append(f"{len(self.lost)} acknowledged message(s) lost: {_ranges(self.lost)}")
            if self.unsynced == len(self.lost) and not (self.st is not None and self.st.damage):
                parts.append("the end of the log, unsynced in batch durability (the session stays writable)")
        if self.st is not None and self.st.damage and not self.lost and not self.header_lost:
            parts.append(f"read-only: {self.st.damage}")
        if self.st is not None:
            parts.append(f"{self.st.last_sequence} sequence number(s) kept")
        return "; ".join(parts) or "ok"


def scan_log(
    data: bytes,
    session_id: str,
    mark: tuple[int, dict[str, Any]] | None,
    default_profile: str,
    *,
    batch: bool = False,
) -> LogScan:
    """Replay a log's bytes into a session, setting bad records aside (pure: no I/O).

    Every line is checked on its own (its CRC32C, then its fit to the session), so one bad
    line costs only itself. Sequence numbers that were acknowledged but cannot be read (a bad
    append record, a gap before the next good one, a tail lost below the highest number the
    records or the mark file recorded) get stand-in rows, so they are never handed out again,
    and the session is marked damaged (read-only). A lost header is rebuilt from the mark file
    (owner, profile, create time) and the first records; such a session is damaged too.

    With ``batch`` (the log was written in batch durability), a tail lost below the mark is what
    a machine crash leaves of appends acknowledged before their batched sync, a loss that mode
    allows: its numbers still get stand-ins, but the session stays writable.
    """
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the data ends with a newline, as every complete log does
    scan = LogScan(None)
    high = mark[0] if mark is not None else 0
    last_time: datetime | None = None
    checked_seen = False
    for index, raw in enumerate(lines):
        try:
            obj, checked = unframe(raw)
            if checked_seen and not checked:
                # Every line after the first checked one is checked: an unchecked one was not
                # written by this store, whatever it says.
                raise BadFrame("unchecked line in a checked log")
            checked_seen = checked_seen or checked
            if not isinstance(obj, dict):
                raise RecordError("not a JSON object")
            if scan.st is None and obj.get("t") == "session":
                scan.st = _header(obj, session_id)
                high = max(high, _int(obj.get("n")))
                continue
            record = _decode(obj)
        except BadFrame as exc:
            scan.bad.append((index + 1, str(exc)))
            continue
        except (ValueError, UnicodeDecodeError, KeyError, IndexError, TypeError, AttributeError) as exc:
            scan.bad.append((index + 1, "unreadable" if isinstance(exc, ValueError | UnicodeDecodeError) else "bad"))
            continue
        if scan.st is None:
            scan.st = _rebuilt_header(session_id, mark, default_profile, record)
            scan.header_lost = True
        st = scan.st
        messages = record.messages if isinstance(record, AppendRecord | CompactionRecord) else ()
        if messages and messages[0].sequence_number > st.last_sequence + 1:
            scan.lost.extend(st.fill_lost(messages[0].sequence_number - 1, "its log record was unreadable", None))
        try:
            st.apply(record)
        except RecordError as exc:
            scan.bad.append((index + 1, f"does not fit: {exc}"))
            continue
        high = max(high, _int(obj.get("n")))
        last_time = record.time or last_time
        scan.overhead += isinstance(record, FlagsRecord | HeaderRecord | StateRecord | SaveViewRecord)
    if tail:
        scan.bad.append((len(lines) + 1, "cut short"))
    # Only the last line bad: what a crash in the middle of a write leaves.
    last_line = len(lines) + 1 if tail else len(lines)
    scan.torn_tail = len(scan.bad) == 1 and scan.bad[0][0] == last_line
    if scan.st is None:
        if mark is None or not mark[1]:
            return scan  # nothing to rebuild from
        scan.st = _rebuilt_header(session_id, mark, default_profile, None)
        scan.header_lost = True
    st = scan.st
    if high > st.last_sequence:
        note = "lost in a machine crash before its batched sync" if batch else "the end of its log was lost"
        lost_tail = st.fill_lost(high, note, last_time)
        scan.lost.extend(lost_tail)
        scan.unsynced = len(lost_tail) if batch else 0
    if scan.header_lost:
        st.damage = st.damage or "the session header was lost and rebuilt"
    elif len(scan.lost) > scan.unsynced:
        st.damage = st.damage or f"{len(scan.lost)} acknowledged message(s) unreadable: {_ranges(scan.lost)}"
    return scan


def _rebuilt_header(
    session_id: str, mark: tuple[int, dict[str, Any]] | None, default_profile: str, first: Record | None
) -> SessionState:
    meta = mark[1] if mark is not None else {}
    created = meta.get("create_time")
    when = datetime.fromisoformat(created) if isinstance(created, str) else getattr(first, "time", None)
    info = SessionInfo(
        id=session_id,
        # Owner unknown without the mark file: "" matches no user, so only admins see it.
        user_id=str(meta.get("user_id", "")),
        profile_id=str(meta.get("profile_id") or default_profile),
        create_time=when,
        update_time=when,
    )
    return SessionState(info)


def _chunk_bytes(chunk: HistoryChunk) -> int:
    """Estimated memory of an indexed history chunk: its text, and its terms about as much again."""
    return ROW_BYTES + 2 * len(chunk.text)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _ranges(seqs: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"#3-5, #9"``."""
    out: list[str] = []
    ordered = sorted(seqs)
    start = prev = ordered[0]
    for seq in [*ordered[1:], 0]:
        if seq == prev + 1:
            prev = seq
            continue
        out.append(f"#{start}" if start == prev else f"#{start}-{prev}")
        start = prev = seq
    return ", ".join(out[:10]) + (" ..." if len(out) > 10 else "")


# -- records <-> JSON --------------------------------------------------------------------------


def _dumps(obj: dict[str, Any]) -> bytes:
    """One checked JSON line (``_frames.frame``); JSON escapes newlines inside strings, so a line
    is always one record.

    orjson writes it, about ten times faster than ``json`` (a turn writes three or four lines).
    Where the two could write different values, ``json`` writes it (``_dumps_standard``): orjson
    refuses a lone surrogate, a key that is not a string and an integer past 64 bits (it raises),
    and writes a NaN or an infinity as ``null``, so a line in which orjson wrote a ``null`` at all
    is written again by ``json``. Any other line reads back the same from either (floats keep
    their value; only the text of some exponents differs). Datetimes (the records' times) are
    written as ``isoformat`` writes them, by both: orjson's own text is the same for every offset
    in whole minutes (UTC, which the store and the system clock stamp, or none)."""
    try:
        body = orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError
        return _dumps_standard(obj)
    if b"null" in body:  # a NaN, an infinity or a None: the reference's reading of it
        return _dumps_standard(obj)
    return frame(body)


def _dumps_standard(obj: dict[str, Any]) -> bytes:
    """``_dumps`` by the standard library: the reference for any value orjson might write otherwise."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=_isoformat)
    try:
        body = text.encode()
    except UnicodeEncodeError:
        # A lone surrogate cannot be UTF-8: the ASCII form escapes it and still round-trips.
        body = json.dumps(obj, separators=(",", ":"), default=_isoformat).encode()
    return frame(body)


def _isoformat(value: Any) -> str:
    """``json``'s writer of the datetimes a record holds (orjson writes the same text itself)."""
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _loads(raw: bytes) -> Any:
    """The record of a checked line, or of a line written before checksums (unchecked)."""
    return unframe(raw)[0]


def _session_line(st: SessionState) -> dict[str, Any]:
    line = {
        "t": "session",
        "format": FORMAT,
        "session": session_to_dict(st.info(0)),
        "requests": {key: list(value) for key, value in st.requests.items()},
        "request_fingerprints": dict(st.request_fingerprints),
        "request_tokens": dict(st.request_tokens),
        "views": [_view_to_dict(v) for v in st.views.values()],
        # The highest sequence number the rows below reach: a log cut short shows it.
        "n": st.last_sequence,
    }
    if st.damage:
        line["damaged"] = st.damage
    return line


def _header(obj: Any, session_id: str) -> SessionState:
    if obj.get("t") != "session" or obj.get("format") != FORMAT:
        raise RecordError("first line is not a session header of a known format")
    info = session_from_dict(obj["session"])
    if info.id != session_id:
        raise RecordError(f"header names session {info.id!r}")
    st = SessionState(info)
    st.damage = str(obj.get("damaged", ""))
    st.requests = {str(key): tuple(int(s) for s in value) for key, value in obj.get("requests", {}).items()}
    st.request_fingerprints = {str(k): str(v) for k, v in obj.get("request_fingerprints", {}).items()}
    st.request_tokens = {str(k): int(v) for k, v in obj.get("request_tokens", {}).items()}
    for view in obj.get("views", ()):
        st.remember_view(_view_from_dict(view), len(obj["views"]))
    return st


_VIEW_FIELDS = tuple(f.name for f in dataclasses.fields(ViewRecord))


def _view_to_dict(view: ViewRecord) -> dict[str, Any]:
    # Field by field: ``dataclasses.asdict`` copies every value deeply (~40 us a view, and
    # BuildContext saves one per build); the values are flat (strings, numbers, the features).
    # ``create_time`` stays a datetime: ``_dumps`` writes it as its isoformat.
    return {name: getattr(view, name) for name in _VIEW_FIELDS}


def _view_from_dict(d: dict[str, Any]) -> ViewRecord:
    features = current_features(d.get("features", ()))  # an older feature set: mapped or dropped
    return ViewRecord(
        **{
            **d,
            "create_time": datetime.fromisoformat(d["create_time"]),
            "features": features,
            "cuts": current_cuts(d.get("cuts")),
        }
    )


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _chunk_to_dict(chunk: HistoryChunk) -> dict[str, Any]:
    d: dict[str, Any] = {
        "t": "chunk",
        "hash": chunk.content_hash,
        "text": chunk.text,
        "first": chunk.first_sequence,
        "last": chunk.last_sequence,
    }
    if chunk.start_time is not None:
        d["start"] = chunk.start_time.isoformat()
    if chunk.end_time is not None:
        d["end"] = chunk.end_time.isoformat()
    if chunk.breadcrumbs:
        d["crumbs"] = list(chunk.breadcrumbs)
    return d


def _chunk_from_dict(d: dict[str, Any]) -> HistoryChunk:
    if d["t"] != "chunk":
        raise ValueError(f"unknown history record type {d['t']!r}")
    texts = (d["hash"], d["text"], *d.get("crumbs", ()))
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("history chunk strings must be strings")
    start, end = d.get("start"), d.get("end")
    return HistoryChunk(
        content_hash=d["hash"],
        text=d["text"],
        first_sequence=int(d["first"]),
        last_sequence=int(d["last"]),
        start_time=datetime.fromisoformat(start) if start is not None else None,
        end_time=datetime.fromisoformat(end) if end is not None else None,
        breadcrumbs=tuple(d.get("crumbs", ())),
    )


def _encode(record: Record, n: int) -> dict[str, Any]:
    """The record's JSON form; ``n`` is the session's highest sequence number once it applies."""
    d: dict[str, Any]
    if isinstance(record, AppendRecord):
        d = {"t": "append", "messages": [message_to_dict(m, raw_time=True) for m in record.messages]}
        if record.request_id:
            d["request_id"] = record.request_id
        if record.request_fingerprint:
            d["fp"] = record.request_fingerprint
        if record.context_tokens_delta:
            d["delta"] = record.context_tokens_delta
    elif isinstance(record, FlagsRecord):
        d = {"t": "flags", "seqs": list(record.sequence_numbers), "is_context": record.is_context}
    elif isinstance(record, HeaderRecord):
        d = {"t": "header", **_given(record, ("name", "pinned", "metadata"))}
    elif isinstance(record, SaveViewRecord):
        d = {"t": "view", "view": _view_to_dict(record.view), "keep": record.keep}
    elif isinstance(record, StateRecord):
        d = {"t": "state", **_given(record, ("context_tokens", "context_truncated", "state"))}
    else:
        d = {
            "t": "compaction",
            "demote": list(record.demote),
            "messages": [message_to_dict(m, raw_time=True) for m in record.messages],
            "context_tokens": record.context_tokens,
        }
        if record.state is not None:
            d["state"] = record.state
    if record.time is not None:
        d["time"] = record.time  # a datetime: ``_dumps`` writes it as its isoformat
    d["n"] = n
    return d


def _given(record: HeaderRecord | StateRecord, keys: tuple[str, ...]) -> dict[str, Any]:
    """The record's fields named in ``keys`` that are set (None: left as they were)."""
    return {key: value for key in keys if (value := getattr(record, key)) is not None}


def _decode(d: dict[str, Any]) -> Record:
    kind = d["t"]
    time = datetime.fromisoformat(d["time"]) if "time" in d else None
    if kind == "append":
        messages = tuple(message_from_dict(m) for m in d["messages"])
        return AppendRecord(time, messages, str(d.get("request_id", "")), int(d.get("delta", 0)), str(d.get("fp", "")))
    if kind == "view":
        return SaveViewRecord(_view_from_dict(d["view"]), int(d["keep"]))
    if time is None:
        raise RecordError(f"{kind!r} record without a time")
    if kind == "flags":
        return FlagsRecord(time, tuple(int(s) for s in d["seqs"]), bool(d["is_context"]))
    if kind == "header":
        return HeaderRecord(time, name=d.get("name"), pinned=d.get("pinned"), metadata=d.get("metadata"))
    if kind == "state":
        return StateRecord(time, d.get("context_tokens"), d.get("context_truncated"), d.get("state"))
    if kind == "compaction":
        messages = tuple(message_from_dict(m) for m in d["messages"])
        demote = tuple(int(s) for s in d["demote"])
        return CompactionRecord(time, demote, messages, int(d["context_tokens"]), d.get("state"))
    raise RecordError(f"unknown record type {kind!r}")
