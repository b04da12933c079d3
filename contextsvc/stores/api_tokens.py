"""API token stores for the memory and files session stores (PostgreSQL: ``postgres/tokens.py``).

The files store keeps every token in one small JSON file, ``tokens.json`` in its data directory
(mode 0600), rewritten whole and atomically (temp file, fsync, ``os.replace``, directory fsync)
on each change. ``contextsvc tokens create`` and the running server may both write it (the server
records ``last_used``), so each change is a read-modify-write under an exclusive ``flock`` on
``tokens.lock``; readers need no lock (a replace is atomic) and notice another process's change by
the file's inode/size/mtime, checked on every lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from contextsvc.core.credentials import ApiToken
from contextsvc.errors import Unavailable

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.json"
LOCK_FILE = "tokens.lock"
_FORMAT_VERSION = 1


class MemoryTokenStore:
    """Tokens in process memory (the memory store; tests)."""

    def __init__(self) -> None:
        self._by_id: dict[str, ApiToken] = {}

    async def add_api_token(self, token: ApiToken) -> None:
        _check_new(self._by_id.values(), token)
        self._by_id[token.token_id] = token

    async def find_api_token(self, token_hash: str) -> ApiToken | None:
        return next((t for t in self._by_id.values() if t.token_hash == token_hash), None)

    async def list_api_tokens(self) -> list[ApiToken]:
        return sorted(self._by_id.values(), key=_order)

    async def revoke_api_token(self, token_id: str, when: datetime) -> ApiToken | None:
        token = self._by_id.get(token_id)
        if token is None:
            return None
        self._by_id[token_id] = token = token.revoked(when)
        return token

    async def touch_api_token(self, token_id: str, when: datetime) -> None:
        token = self._by_id.get(token_id)
        if token is not None and (token.last_used_time is None or token.last_used_time < when):
            self._by_id[token_id] = token.touched(when)


class FilesTokenStore:
    """Tokens in ``<data dir>/tokens.json``, shared safely by the server and the CLI."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.path = self.root / TOKENS_FILE
        self._by_hash: dict[str, ApiToken] = {}
        self._stamp: tuple[int, int, int] | None = None

    async def add_api_token(self, token: ApiToken) -> None:
        def change(tokens: dict[str, ApiToken]) -> None:
            _check_new(tokens.values(), token)
            tokens[token.token_id] = token

        await self._mutate(change)

    async def find_api_token(self, token_hash: str) -> ApiToken | None:
        await self._refresh()
        return self._by_hash.get(token_hash)

    async def list_api_tokens(self) -> list[ApiToken]:
        await self._refresh()
        return sorted(self._by_hash.values(), key=_order)

    async def revoke_api_token(self, token_id: str, when: datetime) -> ApiToken | None:
        found: list[ApiToken] = []

        def change(tokens: dict[str, ApiToken]) -> None:
            token = tokens.get(token_id)
            if token is not None:
                tokens[token_id] = token.revoked(when)
                found.append(tokens[token_id])

        await self._mutate(change)
        return found[0] if found else None

    async def touch_api_token(self, token_id: str, when: datetime) -> None:
        def change(tokens: dict[str, ApiToken]) -> None:
            token = tokens.get(token_id)
            if token is not None and (token.last_used_time is None or token.last_used_time < when):
                tokens[token_id] = token.touched(when)

        await self._mutate(change)

    # -- plumbing ------------------------------------------------------------------------------

    def _current_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    async def _refresh(self) -> None:
        """Reload when another process replaced the file (a stat: cheap enough for every lookup)."""
        try:
            stamp = self._current_stamp()
        except OSError as exc:
            raise _unavailable("read", exc) from None
        if stamp == self._stamp:
            return
        try:
            tokens, stamp = await asyncio.to_thread(self._read)
        except OSError as exc:
            raise _unavailable("read", exc) from None
        self._install(tokens, stamp)

    def _install(self, tokens: dict[str, ApiToken], stamp: tuple[int, int, int] | None) -> None:
        self._by_hash = {t.token_hash: t for t in tokens.values()}
        self._stamp = stamp

    def _read(self) -> tuple[dict[str, ApiToken], tuple[int, int, int] | None]:
        try:
            with open(self.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                raw = fh.read()
        except FileNotFoundError:
            return {}, None
        try:
            data = json.loads(raw)
            if data.get("version") != _FORMAT_VERSION:
                raise ValueError(f"unknown version {data.get('version')!r}")
            tokens = [_from_dict(d) for d in data["tokens"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # Never guess at credentials: a damaged file authenticates nobody until fixed.
            raise OSError(f"{self.path} is not a valid tokens file: {exc}") from None
        return {t.token_id: t for t in tokens}, (st.st_ino, st.st_size, st.st_mtime_ns)

    async def _mutate(self, change: Callable[[dict[str, ApiToken]], None]) -> None:
        try:
            tokens, stamp = await asyncio.to_thread(self._mutate_locked, change)
        except OSError as exc:
            raise _unavailable("write", exc) from None
        self._install(tokens, stamp)

    def _mutate_locked(
        self, change: Callable[[dict[str, ApiToken]], None]
    ) -> tuple[dict[str, ApiToken], tuple[int, int, int] | None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            tokens, _ = self._read()
            change(tokens)
            body = {"version": _FORMAT_VERSION, "tokens": [_to_dict(t) for t in sorted(tokens.values(), key=_order)]}
            _write_private(self.path, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
            return tokens, self._current_stamp()
        finally:
            os.close(fd)  # releases the flock


def _write_private(path: Path, data: bytes) -> None:
    """Atomic replace of a 0600 file: temp file, fsync, ``os.replace``, directory fsync."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _check_new(existing: Any, token: ApiToken) -> None:
    for other in existing:
        if other.token_id == token.token_id or other.token_hash == token.token_hash:
            raise ValueError("a token with this id or hash already exists")


def _order(token: ApiToken) -> tuple[datetime, str]:
    return (token.create_time, token.token_id)


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:  # compared with an aware clock: refused here, not on every call
        raise ValueError(f"time {value!r} has no time zone")
    return parsed


def _flag(value: Any) -> bool:
    # Not bool(value): a hand-edited "false" must not read as true and make an admin.
    if not isinstance(value, bool):
        raise ValueError(f"admin must be true or false, not {value!r}")
    return value


def _to_dict(t: ApiToken) -> dict[str, Any]:
    return {
        "id": t.token_id,
        "sha256": t.token_hash,
        "user": t.user_id,
        "admin": t.is_admin,
        "note": t.note,
        "created": _time(t.create_time),
        "expires": _time(t.expire_time),
        "last_used": _time(t.last_used_time),
        "revoked": _time(t.revoke_time),
    }


def _from_dict(d: dict[str, Any]) -> ApiToken:
    created = _parse_time(d["created"])
    if created is None:
        raise ValueError(f"token {d.get('id')!r} has no creation time")
    return ApiToken(
        token_id=str(d["id"]),
        token_hash=str(d["sha256"]),
        user_id=str(d["user"]),
        is_admin=_flag(d["admin"]),
        note=str(d.get("note", "")),
        create_time=created,
        expire_time=_parse_time(d.get("expires")),
        last_used_time=_parse_time(d.get("last_used")),
        revoke_time=_parse_time(d.get("revoked")),
    )


def _unavailable(action: str, exc: OSError) -> Unavailable:
    # The path and the OS error are for the operator's log, not for a client.
    log.error("token store: cannot %s the tokens file: %s", action, exc)
    return Unavailable(f"the token store cannot be {'written' if action == 'write' else 'read'}; try again later")
