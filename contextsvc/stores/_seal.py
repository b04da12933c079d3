"""The files store's clean-shutdown seal: when the start-up index can be taken without a look at
every log (issue #9: start-up with 10,000 sessions).

An ordinary start checks every index entry against its log's ``stat`` (one system call per
session, the larger part of reading a big data directory). That check guards against logs
changed while no server ran. After a clean stop there is a cheaper guard: the store wrote its
index last, with every session in it, and left a seal in the lock file (``_dirlock``) naming

- the index file's key (inode, size, mtime, ctime): the index is the one written then;
- the sessions folder's key (inode, mtime, ctime): no log was added, removed or renamed since
  (the kernel updates a folder's times whenever one of its names changes);
- how many sessions the index lists.

A start that finds the seal intact (and the index whole by its checksum) takes the index as it
is, and checks the logs' keys in the background once serving (``FilesStore._verify_sealed``):
a log changed in place while the server was down (edited, restored, corrupted) is read whole then,
as a start without the seal would have read it; one used before that is read whole when first used
anyway. The next holder of the lock overwrites the seal before anything is written, so a crash
after that start never leaves a seal behind (``DataDirLock.acquire``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

_KIND = "clean-shutdown"


@dataclass(frozen=True, slots=True)
class Seal:
    index: tuple[int, int, int, int]
    sessions: tuple[int, int, int]
    count: int


def _index_key(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _folder_key(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def seal_note(index: Path, sessions: Path, count: int) -> bytes:
    """The seal for the index and sessions folder as they are now (OSError if either is gone)."""
    record = {"t": _KIND, "index": _index_key(index), "sessions": _folder_key(sessions), "count": count}
    return (json.dumps(record) + "\n").encode()


def read_seal(note: bytes) -> Seal | None:
    """The seal in a lock file's previous content, or None (a holder's line, nothing, garbage)."""
    if b'"clean-shutdown"' not in note:
        return None
    try:
        record = json.loads(note)
        if record.get("t") != _KIND:
            return None
        index = tuple(int(v) for v in record["index"])
        sessions = tuple(int(v) for v in record["sessions"])
        count = int(record["count"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if len(index) != 4 or len(sessions) != 3:
        return None
    return Seal(index, sessions, count)


def seal_holds(seal: Seal | None, index: Path, sessions: Path, count: int) -> bool:
    """Whether nothing the seal names changed: the same index file and no name changed in the
    sessions folder since the clean stop, with ``count`` sessions read from the index."""
    if seal is None or seal.count != count:
        return False
    try:
        return _index_key(index) == seal.index and _folder_key(sessions) == seal.sessions
    except OSError:
        return False
