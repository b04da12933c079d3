"""The files store's start-up index: a summary of every session, so ``open()`` reads one file
instead of every log (issue #9 item 3).

``<data>/index.jsonl`` is a header line, then one line per session, each a checked record
(``_frames``: CRC32C + the record)::

    {"t": "index", "format": 1, "preview_chars": 160}
    {"s": {...header fields...}, "d": 12, "x": 9, "q": 14, "p": "preview", "o": 3,
     "k": [inode, size, mtime_ns, ctime_ns]}

``s`` are the header fields (``core/codec.session_to_dict``), ``d`` / ``x`` / ``q`` the display
and context counts and the last sequence number, ``p`` the listing preview (cut to
``preview_chars``), ``o`` the flag/header/state/view records since the log was last written whole
(what decides a background compaction), ``k`` the key of the log file the summary was taken from.

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
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextsvc.core.codec import session_from_dict, session_to_dict
from contextsvc.core.session import SessionInfo
from contextsvc.stores._frames import BadFrame, checked_body, frame, unframe

logger = logging.getLogger(__name__)

INDEX_NAME = "index.jsonl"
INDEX_FORMAT = 1

#: (inode, size, mtime_ns, ctime_ns) of a log file.
FileKey = tuple[int, int, int, int]


def file_key(stat: os.stat_result) -> FileKey:
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@dataclass(slots=True, frozen=True)
class IndexEntry:
    """One session's summary (counters and preview in ``info``) and the log it was taken from."""

    info: SessionInfo
    key: FileKey
    overhead: int = 0
    #: the entry's line as read from the index (written again as is while the log is unchanged).
    line: bytes = b""


def encode_entry(entry: IndexEntry) -> bytes:
    if entry.line:
        return entry.line
    info = entry.info
    record = {
        "s": session_to_dict(info),
        "d": info.display_message_count,
        "x": info.context_message_count,
        "q": info.last_sequence,
        "p": info.preview,
        "o": entry.overhead,
        "k": list(entry.key),
    }
    return _line(record)


def _line(record: dict[str, Any]) -> bytes:
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    try:
        body = text.encode()
    except UnicodeEncodeError:  # a lone surrogate: the ASCII form escapes it
        body = json.dumps(record, separators=(",", ":")).encode()
    return frame(body)


def _decode_entry(record: Any, line: bytes) -> IndexEntry:
    if not isinstance(record, dict):
        raise ValueError("not an object")
    key = record["k"]
    if len(key) != 4:
        raise ValueError("bad file key")
    # One SessionInfo straight from the record, counters included (start-up decodes one per session).
    info = session_from_dict(
        record["s"],
        display_message_count=int(record["d"]),
        context_message_count=int(record["x"]),
        last_sequence=int(record["q"]),
        preview=str(record["p"]),
    )
    return IndexEntry(info, (int(key[0]), int(key[1]), int(key[2]), int(key[3])), int(record.get("o", 0)), line)


def _parse_bodies(bodies: list[bytes]) -> list[Any]:
    """The JSON value of each body: one ``json.loads`` over all of them (a call per line costs
    more than the parsing itself at 10,000 sessions); per body, with None for one that does not
    parse, if the whole does not split back into exactly one object per body."""
    try:
        values = json.loads(b"[" + b",".join(bodies) + b"]")
    except ValueError:
        values = None
    if isinstance(values, list) and len(values) == len(bodies) and all(isinstance(v, dict) for v in values):
        return values
    out: list[Any] = []
    for body in bodies:
        try:
            out.append(json.loads(body))
        except ValueError:
            out.append(None)
    return out


def header_line(preview_chars: int) -> bytes:
    return _line({"t": "index", "format": INDEX_FORMAT, "preview_chars": preview_chars})


def read_index(path: Path, preview_chars: int) -> dict[str, IndexEntry] | None:
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
        or head.get("format") != INDEX_FORMAT
        or head.get("preview_chars") != preview_chars
    ):
        logger.warning("files store: the start-up index %s is unreadable or of another kind; reading every log", path)
        return None
    entries: dict[str, IndexEntry] = {}
    bad = 1 if tail else 0
    raws: list[bytes] = []
    bodies: list[bytes] = []
    for raw in lines[1:]:
        try:
            bodies.append(checked_body(raw))
        except BadFrame:
            bad += 1
            continue
        raws.append(raw)
    for record, raw in zip(_parse_bodies(bodies), raws, strict=True):
        try:
            entry = _decode_entry(record, raw + b"\n")
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1
            continue
        entries[entry.info.id] = entry
    if bad:
        logger.warning("files store: %d unreadable line(s) in the start-up index; those logs are read whole", bad)
    return entries


def index_bytes(lines: Iterable[bytes], preview_chars: int) -> bytes:
    return header_line(preview_chars) + b"".join(lines)
