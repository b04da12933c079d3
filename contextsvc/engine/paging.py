"""Opaque AIP-158 page tokens: an offset bound to the filter that produced it."""

from __future__ import annotations

import base64
import hashlib
import json

from contextsvc.errors import InvalidArgument


def _filter_hash(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


def encode_page_token(offset: int, *filter_parts: str) -> str:
    raw = json.dumps({"o": offset, "f": _filter_hash(*filter_parts)}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str, *filter_parts: str, field: str = "page_token") -> int:
    """The offset a token stands for; a foreign, corrupt or mismatched token is INVALID_ARGUMENT."""
    if not token:
        return 0
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        offset = data["o"]
        filter_hash = data["f"]
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument.field(field, "is not a token this service issued") from None
    if not isinstance(offset, int) or offset < 0:
        raise InvalidArgument.field(field, "is not a token this service issued")
    if filter_hash != _filter_hash(*filter_parts):
        raise InvalidArgument.field(field, "was issued for a different filter; start again without it")
    return offset
