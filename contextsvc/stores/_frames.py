"""Checked log lines and the per-session sequence mark of the files store (issue #9).

A checked line wraps one JSON record with the CRC32C of its bytes::

    {"c":"1a2b3c4d","r":{...record...}}\\n

The checksum covers exactly the bytes of ``{...record...}`` as written, so checking it needs no
re-serialization, and the line is still one JSON object (``jq .r`` reads a log). Lines without
the wrapper are the format written before checksums and are read as before, unchecked.

CRC32C (Castagnoli) rather than zlib's CRC32: it detects more error patterns at the same width,
is what storage systems use for this purpose, and google-crc32c computes it in hardware.

The mark file ``sessions/<id>.jsonl.mark`` holds the highest sequence number the session ever
handed out (a fixed-width first line, rewritten in place after each numbered record reached
the log) and, on its second line, the header fields that never change (owner, profile, create
time). It outlives damage to the log: a log cut short, or gone, still tells how many messages
were acknowledged, so numbers are never handed out twice, and a lost header can be rebuilt.
It is written after the log (never ahead of it) and not fsynced on its own: a machine crash can
leave it behind the log, never ahead, and the loader takes the higher of the two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import google_crc32c

_HEAD = b'{"c":"'
_MID = b'","r":'
_PREFIX = len(_HEAD) + 8 + len(_MID)
_MARK_WIDTH = 20


class BadFrame(ValueError):
    """A checked line whose checksum does not match (or whose wrapper is broken)."""


def frame(body: bytes) -> bytes:
    """One checked line around ``body`` (a JSON object's bytes, without a newline)."""
    return b"%s%08x%s%s}\n" % (_HEAD, google_crc32c.value(body), _MID, body)


def checked_body(raw: bytes) -> bytes:
    """The record bytes of a checked line (without its newline), its checksum verified.

    Raises ``BadFrame`` for a line without the wrapper or one failing its check; the bytes are
    not parsed, so a reader of many lines can parse them in one go.
    """
    if not raw.startswith(_HEAD):
        raise BadFrame("no checksum wrapper")
    if len(raw) < _PREFIX + 3 or raw[_PREFIX - len(_MID) : _PREFIX] != _MID or not raw.endswith(b"}"):
        raise BadFrame("broken checksum wrapper")
    body = raw[_PREFIX:-1]
    try:
        expected = int(raw[len(_HEAD) : len(_HEAD) + 8], 16)
    except ValueError:
        raise BadFrame("unreadable checksum") from None
    if google_crc32c.value(body) != expected:
        raise BadFrame("checksum mismatch")
    return body


def frame_body(raw: bytes) -> bytes:
    """The record bytes of a checked line known to be intact (``checked_body`` without the check),
    for a reader that verified a checksum over many lines at once."""
    return raw[_PREFIX:-1]


def unframe(raw: bytes) -> tuple[Any, bool]:
    """The record of one line (without its newline) and whether it was checked.

    Raises ``BadFrame`` for a checked line that fails its check, and ``ValueError`` (JSON)
    for a line that is not JSON at all.
    """
    if raw.startswith(_HEAD):
        return json.loads(checked_body(raw)), True
    return json.loads(raw), False


def mark_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name + ".mark")


def mark_bytes(n: int, meta: dict[str, Any]) -> bytes:
    """The whole mark file: the number, then the header fields that never change."""
    return b"%0*d\n" % (_MARK_WIDTH, n) + json.dumps(meta, separators=(",", ":")).encode() + b"\n"


def write_mark(path: Path, n: int, meta: dict[str, Any]) -> None:
    """Write the whole mark file. Not atomic and not fsynced, on purpose: a mark cut short is
    unreadable and simply rebuilt from the log on the next start (it is never ahead of the log),
    and the first start over thousands of logs written before marks existed stays fast."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, mark_bytes(n, meta))
    finally:
        os.close(fd)


def write_mark_number(path: Path, n: int) -> None:
    """Rewrite the number in place (same width: no truncation, no torn file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, b"%0*d\n" % (_MARK_WIDTH, n), 0)
    finally:
        os.close(fd)


def read_mark(path: Path) -> tuple[int, dict[str, Any]] | None:
    """(highest sequence number, header fields) or None when missing or unreadable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    head, _, rest = data.partition(b"\n")
    try:
        n = int(head)
    except ValueError:
        return None
    meta: dict[str, Any] = {}
    try:
        parsed = json.loads(rest.split(b"\n", 1)[0]) if rest.strip() else {}
        if isinstance(parsed, dict):
            meta = parsed
    except ValueError:
        pass
    return (n if n >= 0 else 0), meta
