"""API tokens (DESIGN §5.10): how they look, how they are stored, when they are valid.

A token is ``ctx_`` followed by 43 URL-safe characters: 32 bytes (256 bits) from ``secrets``. The
prefix makes a leaked token easy to recognise (secret scanners, log greps). It is shown once, at
creation; stores keep only its SHA-256. A slow password hash (bcrypt, argon2) protects secrets a
person chose, which are guessable; a 256-bit random token cannot be guessed, so one SHA-256 is
enough to make a stolen copy of the store useless, and it lets every store find a token by an
indexed lookup of its hash instead of comparing against every record.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum

from contextsvc.core.session import ANONYMOUS

TOKEN_PREFIX = "ctx_"
#: bytes of randomness in a token (256 bits; the issue asks for at least 128).
TOKEN_BYTES = 32
#: a well-formed token: the prefix and exactly the characters ``secrets.token_urlsafe`` produces.
_TOKEN_SHAPE = re.compile(r"^ctx_[A-Za-z0-9_-]{43}$")
#: user names: what an operator types; no spaces, no control characters, bounded.
_USER_SHAPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$")
_DURATION = re.compile(r"^(\d{1,6})([hdw])$")
_UNITS = {"h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


class TokenState(StrEnum):
    ACTIVE = "active"
    REVOKED = "revoked"
    EXPIRED = "expired"


@dataclass(slots=True, frozen=True)
class ApiToken:
    """A stored token: never the token itself, only its hash."""

    token_id: str
    token_hash: str
    user_id: str
    is_admin: bool
    create_time: datetime
    note: str = ""
    expire_time: datetime | None = None
    last_used_time: datetime | None = None
    revoke_time: datetime | None = None

    def state(self, now: datetime) -> TokenState:
        if self.revoke_time is not None:
            return TokenState.REVOKED
        if self.expire_time is not None and now >= self.expire_time:
            return TokenState.EXPIRED
        return TokenState.ACTIVE

    def touched(self, when: datetime) -> ApiToken:
        return replace(self, last_used_time=when)

    def revoked(self, when: datetime) -> ApiToken:
        return self if self.revoke_time is not None else replace(self, revoke_time=when)


@dataclass(slots=True, frozen=True)
class IssuedToken:
    """What ``issue`` returns: the record to store and the secret to show once."""

    record: ApiToken
    secret: str


def hash_token(secret: str) -> str:
    """The stored form of a token (hex SHA-256 of its UTF-8 bytes)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def looks_like_token(secret: str) -> bool:
    return bool(_TOKEN_SHAPE.match(secret))


def check_user(user: str) -> str:
    """A user name as given to ``tokens create``; ValueError naming the rule otherwise."""
    if not _USER_SHAPE.match(user):
        raise ValueError(f"user name {user!r} must be 1-128 characters: letters, digits and . _ @ + - (not first)")
    if user == ANONYMOUS.user_id:
        # Sessions made while authentication was off belong to it: a token acting as it would own them.
        raise ValueError(f"user name {user!r} is reserved for callers without a token")
    return user


def parse_expiry(text: str, now: datetime) -> datetime | None:
    """``90d``, ``12h``, ``4w`` after ``now``; ``never`` is no expiry. Nothing else is: an empty
    value or ``0`` (a script's unset variable, "expire now"?) is refused rather than read as never."""
    value = text.strip().lower()
    if value == "never":
        return None
    match = _DURATION.match(value)
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"expiry {text!r} must be a positive number of hours, days or weeks (12h, 90d, 4w) or never")
    return now + int(match.group(1)) * _UNITS[match.group(2)]


def issue(*, user: str, is_admin: bool, now: datetime, expire_time: datetime | None, note: str = "") -> IssuedToken:
    """A new token for ``user``. The secret is returned once and never stored."""
    secret = TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
    record = ApiToken(
        token_id=secrets.token_hex(6),
        token_hash=hash_token(secret),
        user_id=check_user(user),
        is_admin=is_admin,
        create_time=now,
        note=note,
        expire_time=expire_time,
    )
    return IssuedToken(record=record, secret=secret)


def bearer_token(header: str) -> str | None:
    """The token of an ``authorization`` value ``Bearer <token>`` (scheme case-insensitive,
    RFC 6750); None when the value has another form."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = rest.strip()
    return token or None
