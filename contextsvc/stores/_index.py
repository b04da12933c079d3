"""The files store's start-up index: a summary of every session, so ``open()`` reads one file
instead of every log (issue #9 item 3).

``<data>/index.jsonl`` is a header line, then one line per session, each a checked record
(``_frames``: CRC32C + the record)::

    {"t": "index", "format": 2, "preview_chars": 160}
    ["<id>", "<user>", "<profile>", "<name>", false, {metadata}, "<create_time>", "<update_time>",
     0, false, {state}, 12, 9, 14, "preview", 3, inode, size, mtime_ns, ctime_ns]

A session's record is an array in the order of ``FIELDS``: the header fields (as
``core/codec.session_to_dict`` writes them), the display and context counts and the last sequence
number, the listing preview (cut to ``preview_chars``), the flag/header/state/view records since the
log was last written whole (what decides a background compaction), and the key of the log file the
summary was taken from. An array rather than an object (format 1, still read: an index written
before this format is used, and written in this one next time): at 10,000 sessions, parsing the
keys of every object was most of the index's parse time, and start-up parses every line.
Nothing is built per session at start beyond what the store keeps (``summary_state``): the
``SessionInfo`` of an entry is made only if asked for.

Staleness is per log: an entry is used only when its key equals the log's ``stat`` now. The store
only ever appends to a log (its size grows) or replaces it whole (a new inode), so a log changed
after its entry was written never matches; ``ctime`` also changes on any write by anyone else, even
one that restores ``mtime``. A log without a usable entry (no entry, another key, a line failing its
check) is read whole, as before the index existed; a missing, unreadable or foreign index (another
format or preview length) means every log is read, and the index is written again.
Entries are written only for logs whose size on disk equals the size the store wrote with the
summary, so a write in flight while the index is taken leaves that entry out rather than stale.
Damaged sessions are never indexed: they are read whole at every start.

Writing it is atomic (temp file, fsync, rename, directory fsync): a crash leaves the old index or the
new one, and either is safe, since a stale entry is detected by its key.

The header also carries the CRC32C of everything after it (``"crc"``): when it matches, the lines
are taken without checking each one's own checksum (one C call over 4 MB instead of 10,000 Python
calls); when it does not (or an index written before has none), every line is checked and only the
failing ones are left out, as before. The values are parsed by orjson (the same values as the
standard library's parser, about three times faster at this size), with ``json`` as the fallback.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import google_crc32c
import orjson

from contextsvc.core.codec import parse_time, session_from_dict, session_to_dict
from contextsvc.core.session import SessionInfo
from contextsvc.stores._frames import BadFrame, checked_body, frame, frame_body, unframe
from contextsvc.stores._session import SessionState

logger = logging.getLogger(__name__)

INDEX_NAME = "index.jsonl"
INDEX_FORMAT = 2
#: formats read: 1 (objects) is the one written before arrays.
_READ_FORMATS = (1, 2)

#: (inode, size, mtime_ns, ctime_ns) of a log file.
FileKey = tuple[int, int, int, int]

#: the order of a format-2 record's values.
FIELDS = (
    "id",
    "user_id",
    "profile_id",
    "name",
    "pinned",
    "metadata",
    "create_time",
    "update_time",
    "context_tokens",
    "context_truncated",
    "state",
    "display_message_count",
    "context_message_count",
    "last_sequence",
    "preview",
    "overhead",
    "inode",
    "size",
    "mtime_ns",
    "ctime_ns",
)
_WIDTH = len(FIELDS)


def file_key(stat: os.stat_result) -> FileKey:
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


class IndexEntry:
    """One session's summary (counters and preview) and the log it was taken from.

    Made by the store from a ``SessionInfo`` (to be written), or read from the index: then it holds
    the record's values, and ``info`` is built only when asked for (start-up builds the store's
    summary straight from the values, ``summary_state``)."""

    __slots__ = ("_info", "key", "line", "overhead", "values")

    def __init__(
        self,
        info: SessionInfo | None,
        key: FileKey,
        overhead: int = 0,
        line: bytes = b"",
        values: list[Any] | None = None,
    ) -> None:
        if info is None and values is None:
            raise ValueError("an index entry needs its info or its record's values")
        self._info = info
        self.key = key
        self.overhead = overhead
        #: the entry's line as read from the index (written again as is while the log is unchanged).
        self.line = line
        #: the format-2 record's values (``FIELDS``), when read from an index.
        self.values = values

    @property
    def info(self) -> SessionInfo:
        info = self._info
        if info is None:
            assert self.values is not None
            v = self.values
            info = self._info = SessionInfo(
                id=v[0],
                user_id=v[1],
                profile_id=v[2],
                name=v[3],
                pinned=v[4],
                metadata=v[5],
                create_time=parse_time(v[6]),
                update_time=parse_time(v[7]),
                context_tokens=v[8],
                context_truncated=v[9],
                state=v[10],
                display_message_count=v[11],
                context_message_count=v[12],
                last_sequence=v[13],
                preview=v[14],
            )
        return info

    def summary_state(self) -> SessionState:
        """The store's summary of the session (``SessionState.summary``), made from the record's
        values without a ``SessionInfo`` between; it takes the entry's dicts (freshly decoded)."""
        v = self.values
        if v is None:
            return SessionState.summary(self.info, share=True)
        return SessionState.summary_of(
            v[0], v[1], v[2], v[3], v[4], v[5], parse_time(v[6]), parse_time(v[7]), v[8], v[9], v[10],
            v[11], v[12], v[13], v[14],
        )  # fmt: skip

    def __repr__(self) -> str:
        sid = self.values[0] if self.values is not None else self.info.id
        return f"IndexEntry({sid!r}, key={self.key}, overhead={self.overhead})"


def encode_entry(entry: IndexEntry) -> bytes:
    if entry.line:
        return entry.line
    info = entry.info
    header = session_to_dict(info)
    record = [
        *(header[name] for name in FIELDS[:11]),
        info.display_message_count,
        info.context_message_count,
        info.last_sequence,
        info.preview,
        entry.overhead,
        *entry.key,
    ]
    return _line(record)


def _line(record: Any) -> bytes:
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    try:
        body = text.encode()
    except UnicodeEncodeError:  # a lone surrogate: the ASCII form escapes it
        body = json.dumps(record, separators=(",", ":")).encode()
    return frame(body)


def _decode_entry(record: Any, line: bytes) -> IndexEntry:
    """A format-2 record (an array of ``FIELDS``); the line is kept to be written again as is.

    Only the shape is checked here: the line passed its checksum, so it is what the store wrote.
    A key that is not four numbers never equals a log's ``stat``, so that entry goes unused."""
    if type(record) is not list or len(record) != _WIDTH or type(record[0]) is not str:
        raise ValueError("not a record of this format")
    overhead = record[15]
    return IndexEntry(
        None, (record[16], record[17], record[18], record[19]), overhead if type(overhead) is int else 0, line, record
    )


def _decode_entry_v1(record: Any) -> IndexEntry:
    """A format-1 record (an object); its line is not kept, so it is written in format 2 next time."""
    if not isinstance(record, dict):
        raise ValueError("not an object")
    key = record["k"]
    if len(key) != 4:
        raise ValueError("bad file key")
    info = session_from_dict(
        record["s"],
        display_message_count=int(record["d"]),
        context_message_count=int(record["x"]),
        last_sequence=int(record["q"]),
        preview=str(record["p"]),
    )
    return IndexEntry(info, (int(key[0]), int(key[1]), int(key[2]), int(key[3])), int(record.get("o", 0)))


def _parse_bodies(bodies: list[bytes], kind: type) -> list[Any]:
    """The JSON value of each body: one ``json.loads`` over all of them (a call per line costs
    more than the parsing itself at 10,000 sessions); per body, with None for one that does not
    parse, if the whole does not split back into exactly one value of ``kind`` per body."""
    try:
        values = orjson.loads(b"[" + b",".join(bodies) + b"]")
    except ValueError:  # orjson refuses a few things json reads (a lone surrogate escape, say)
        try:
            values = json.loads(b"[" + b",".join(bodies) + b"]")
        except ValueError:
            values = None
    if isinstance(values, list) and len(values) == len(bodies) and all(type(v) is kind for v in values):
        return values
    out: list[Any] = []
    for body in bodies:
        try:
            out.append(json.loads(body))
        except ValueError:
            out.append(None)
    return out


def header_line(preview_chars: int, body: bytes) -> bytes:
    """The header of an index whose lines after it are ``body``."""
    crc = f"{google_crc32c.value(body):08x}"
    return _line({"t": "index", "format": INDEX_FORMAT, "preview_chars": preview_chars, "crc": crc})


class Entries(dict[str, IndexEntry]):
    """The entries of an index read, by session id; ``current``: the index is of the format
    written now (one of an older format is worth writing again); ``whole``: every line is as
    written (the header's checksum of them all matched)."""

    current = True
    whole = False


def read_index(path: Path, preview_chars: int) -> Entries | None:
    """The entries by session id; None when there is no usable index (missing, unreadable, of
    another format or preview length). Lines failing their check are left out (logged)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("files store: cannot read the start-up index %s: %s; reading every log", path, exc)
        return None
    lines = data.split(b"\n")
    tail = lines.pop()
    try:
        head, _checked = unframe(lines[0]) if lines else (None, False)
    except (BadFrame, ValueError, UnicodeDecodeError):
        head = None
    if (
        not isinstance(head, dict)
        or head.get("t") != "index"
        or head.get("format") not in _READ_FORMATS
        or head.get("preview_chars") != preview_chars
    ):
        logger.warning("files store: the start-up index %s is unreadable or of another kind; reading every log", path)
        return None
    current = head["format"] == INDEX_FORMAT
    entries = Entries()
    # An index without the whole checksum (written before it existed) is written again at open.
    entries.current = current and "crc" in head
    bad = 1 if tail else 0
    raws: list[bytes] = lines[1:]
    bodies: list[bytes]
    whole = data[len(lines[0]) + 1 :]
    if not tail and head.get("crc") == f"{google_crc32c.value(whole):08x}":
        # Every line is as written: the lines' own checksums need no second look.
        bodies = [frame_body(raw) for raw in raws]
        entries.whole = True
    else:
        raws, bodies = [], []
        for raw in lines[1:]:
            try:
                bodies.append(checked_body(raw))
            except BadFrame:
                bad += 1
                continue
            raws.append(raw)
    for record, raw in zip(_parse_bodies(bodies, list if current else dict), raws, strict=True):
        try:
            entry = _decode_entry(record, raw + b"\n") if current else _decode_entry_v1(record)
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1
            continue
        entries[entry.values[0] if entry.values is not None else entry.info.id] = entry
    if bad:
        entries.whole = False
        logger.warning("files store: %d unreadable line(s) in the start-up index; those logs are read whole", bad)
    return entries


def index_bytes(lines: Iterable[bytes], preview_chars: int) -> bytes:
    body = b"".join(lines)
    return header_line(preview_chars, body) + body
