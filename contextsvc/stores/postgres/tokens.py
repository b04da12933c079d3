"""API tokens in PostgreSQL (table ``api_tokens``, migration 2 of ``schema.py``).

It runs its statements through the owning store's ``read``/``write`` helpers, so driver errors
are mapped (``errors.py``) and writes are shielded exactly like the store's own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

from contextsvc.core.credentials import ApiToken

T = TypeVar("T")
Runner = Callable[[str, Callable[[Any], Awaitable[T]]], Awaitable[T]]

_COLUMNS = "token_hash, token_id, user_id, is_admin, note, create_time, expire_time, last_used_time, revoke_time"


class PostgresTokenStore:
    """``ApiTokenStore`` over the pool of a ``PostgresStore``."""

    def __init__(self, read: Runner[Any], write: Runner[Any]) -> None:
        self._read = read
        self._write = write

    async def add_api_token(self, token: ApiToken) -> None:
        async def work(conn: Any) -> None:
            await conn.execute(
                f"INSERT INTO api_tokens ({_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                token.token_hash,
                token.token_id,
                token.user_id,
                token.is_admin,
                token.note,
                token.create_time,
                token.expire_time,
                token.last_used_time,
                token.revoke_time,
            )

        await self._write("add api token", work)

    async def find_api_token(self, token_hash: str) -> ApiToken | None:
        async def work(conn: Any) -> ApiToken | None:
            row = await conn.fetchrow(f"SELECT {_COLUMNS} FROM api_tokens WHERE token_hash = $1", token_hash)
            return _token(row) if row is not None else None

        result: ApiToken | None = await self._read("find api token", work)
        return result

    async def list_api_tokens(self) -> list[ApiToken]:
        async def work(conn: Any) -> list[ApiToken]:
            rows = await conn.fetch(f"SELECT {_COLUMNS} FROM api_tokens ORDER BY create_time, token_id")
            return [_token(r) for r in rows]

        result: list[ApiToken] = await self._read("list api tokens", work)
        return result

    async def revoke_api_token(self, token_id: str, when: datetime) -> ApiToken | None:
        async def work(conn: Any) -> ApiToken | None:
            row = await conn.fetchrow(
                f"""UPDATE api_tokens SET revoke_time = coalesce(revoke_time, $2)
                     WHERE token_id = $1 RETURNING {_COLUMNS}""",
                token_id,
                when,
            )
            return _token(row) if row is not None else None

        result: ApiToken | None = await self._write("revoke api token", work)
        return result

    async def touch_api_token(self, token_id: str, when: datetime) -> None:
        async def work(conn: Any) -> None:
            await conn.execute(
                """UPDATE api_tokens SET last_used_time = $2
                    WHERE token_id = $1 AND (last_used_time IS NULL OR last_used_time < $2)""",
                token_id,
                when,
            )

        await self._write("touch api token", work)


def _token(row: Any) -> ApiToken:
    return ApiToken(
        token_id=row["token_id"],
        token_hash=row["token_hash"],
        user_id=row["user_id"],
        is_admin=row["is_admin"],
        note=row["note"],
        create_time=row["create_time"],
        expire_time=row["expire_time"],
        last_used_time=row["last_used_time"],
        revoke_time=row["revoke_time"],
    )
