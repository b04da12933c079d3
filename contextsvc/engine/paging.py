"""Opaque AIP-158 page tokens, bound to the filter that produced them.

Two kinds: a position in the session listing (``ListSessions``: the order key of the last session
of the page just returned) and a position in a message buffer
(``ListMessages``): the ``(anchor, sequence)`` context-order key of the oldest row of the page
just returned, so the next page holds exactly the rows placed before it. Both are URL-safe
base64 of a small JSON object; callers treat them as opaque.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from contextsvc.core.session import MAX_EPOCH_MICROS, ListPosition, is_session_id
from contextsvc.errors import InvalidArgument


def _filter_hash(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


def _encode(body: dict[str, Any], filter_parts: tuple[str, ...]) -> str:
    raw = json.dumps({**body, "f": _filter_hash(*filter_parts)}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode(token: str, filter_parts: tuple[str, ...], field: str) -> dict[str, Any]:
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        filter_hash = data["f"]
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument.field(field, "is not a token this service issued") from None
    if not isinstance(data, dict):
        raise InvalidArgument.field(field, "is not a token this service issued")
    if filter_hash != _filter_hash(*filter_parts):
        raise InvalidArgument.field(field, "was issued for a different filter; start again without it")
    return data


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def decode_page_token(token: str, *filter_parts: str, field: str = "page_token") -> int:
    """The offset a token stands for; a foreign, corrupt or mismatched token is INVALID_ARGUMENT."""
    return _offset(_decode(token, filter_parts, field), field) if token else 0


def _offset(data: dict[str, Any], field: str) -> int:
    offset = data.get("o")
    if not _count(offset):
        raise InvalidArgument.field(field, "is not a token this service issued")
    assert isinstance(offset, int)
    return offset


def encode_listing_token(position: ListPosition, offset: int, *filter_parts: str) -> str:
    """A position, and the offset the same page ends at as the listing stood (what a replica
    still on offset tokens reads, during a rolling upgrade)."""
    return _encode({"k": [position.pinned, position.update_micros, position.session_id], "o": offset}, filter_parts)


def decode_listing_token(token: str, *filter_parts: str, field: str = "page_token") -> tuple[ListPosition | None, int]:
    """Where a listing token says the next page starts: after a position (``encode_listing_token``)
    with the offset it stood for, or at an offset alone (a token of a server before positions;
    still honoured across an upgrade). No token: ``(None, 0)``. A foreign, corrupt, mismatched or
    forged token (the token is not signed: a time past what a date holds, an id no session has
    the form of) is INVALID_ARGUMENT."""
    if not token:
        return None, 0
    data = _decode(token, filter_parts, field)
    key = data.get("k")
    offset = _offset(data, field) if "o" in data or key is None else 0
    if key is None:
        return None, offset
    if (
        isinstance(key, list)
        and len(key) == 3
        and isinstance(key[0], bool)
        and isinstance(key[1], int)
        and not isinstance(key[1], bool)
        and 0 <= key[1] <= MAX_EPOCH_MICROS
        and is_session_id(key[2])
    ):
        return ListPosition(key[0], key[1], key[2]), offset
    raise InvalidArgument.field(field, "is not a token this service issued")


def encode_position_token(position: tuple[int, int], *filter_parts: str) -> str:
    return _encode({"p": [position[0], position[1]]}, filter_parts)


def decode_position_token(token: str, *filter_parts: str, field: str = "page_token") -> tuple[int, int] | None:
    """The buffer position a token stands for (None for no token); a foreign, corrupt or
    mismatched token is INVALID_ARGUMENT."""
    if not token:
        return None
    position = _decode(token, filter_parts, field).get("p")
    if not (isinstance(position, list) and len(position) == 2 and all(_count(v) for v in position)):
        raise InvalidArgument.field(field, "is not a token this service issued")
    return (position[0], position[1])
