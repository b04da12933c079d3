"""asyncpg and socket errors translated to domain errors, in one place.

Nothing raised by the driver leaves the PostgreSQL adapter: an unreachable, restarting,
overloaded or read-only server is ``Unavailable`` (the client may retry), a serialization failure is
``Conflict``, a session deleted under a statement is ``NotFound``, text PostgreSQL cannot store
is ``InvalidArgument``, a URL asyncpg refuses to use, or one the server refuses when the store
opens, is ``ValueError`` (a misconfiguration), anything else is ``Internal`` with reason
``STORE_ERROR`` (logged with its SQLSTATE and traceback).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg

from contextsvc.errors import Conflict, ContextError, Internal, InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)

# asyncpg raises this client-side DataError (an InterfaceError) when it cannot encode an argument;
# ``asyncpg.DataError`` is the unrelated server-side class 22.
_ClientDataError = asyncpg.exceptions._base.DataError

#: A pooled connection that died under us (server restart, network cut): a fresh one may work.
STALE_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.ConnectionFailureError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.InternalClientError,
    # A primary demoted to a standby (or a database switched read-only): a fresh connection may
    # reach the new primary.
    asyncpg.ReadOnlySQLTransactionError,
)

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,  # refused, reset, unreachable, DNS
    TimeoutError,  # connect, acquire and command timeouts (asyncio.TimeoutError is this in 3.11)
    asyncpg.PostgresConnectionError,  # class 08
    asyncpg.OperatorInterventionError,  # class 57: shutdown, starting up, statement timeout
    asyncpg.InsufficientResourcesError,  # class 53: too many connections, disk full
    asyncpg.LockNotAvailableError,  # lock_timeout
    asyncpg.InvalidCatalogNameError,  # the database does not exist
    asyncpg.InvalidAuthorizationSpecificationError,  # class 28: role or password refused
    asyncpg.InvalidPasswordError,
    asyncpg.ReadOnlySQLTransactionError,  # 25006: a standby or a read-only database, until failover
)


#: Answers of a running server to the store's first connection that no retry mends: the database
#: the URL names does not exist, the role or its password is refused. At open (``serve``'s start,
#: ``tokens``, ``fsck``) they are a misconfiguration, one line and a non-zero exit; a database
#: still starting answers ``CannotConnectNowError`` (class 57), an outage, retried. Once open they
#: stay ``Unavailable`` (a database dropped or a password rotated under a running server).
_REFUSED_AT_OPEN: tuple[type[asyncpg.PostgresError], ...] = (
    asyncpg.InvalidCatalogNameError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidPasswordError,
)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:160]


def _unavailable_message(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "PostgreSQL did not answer in time"
    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
        return "PostgreSQL is read-only (a standby, or a read-only database): writes wait for a primary"
    if isinstance(exc, asyncpg.QueryCanceledError):
        return "PostgreSQL cancelled the statement (statement timeout)"
    return f"PostgreSQL unavailable: {_short(exc)}"


@contextmanager
def pg_errors(operation: str) -> Iterator[None]:
    """Run a block of driver calls; re-raise what they raise as domain errors."""
    try:
        yield
    except ContextError:
        raise
    except _REFUSED_AT_OPEN as exc:
        if operation == "open":
            raise ValueError(f"PostgreSQL refused to open the store: {_short(exc)} (SQLSTATE {exc.sqlstate})") from None
        raise Unavailable(_unavailable_message(exc), metadata={"operation": operation}) from None
    except _UNAVAILABLE as exc:
        raise Unavailable(_unavailable_message(exc), metadata={"operation": operation}) from None
    except _ClientDataError as exc:
        # Our own bug (a value of the wrong type for a column): not the client's, not transient.
        log.error("store encoding error", extra={"operation": operation, "error": _short(exc)}, exc_info=exc)
        raise Internal("store encoding error", reason="STORE_ERROR", metadata={"operation": operation}) from None
    except asyncpg.ClientConfigurationError as exc:
        # The URL itself is wrong (``sslmode=bogus``): no retry mends it. A misconfiguration, so
        # ``serve`` stops in one line instead of waiting NOT_SERVING for ever (README, start-up).
        raise ValueError(f"the PostgreSQL URL is not usable: {_short(exc)}") from None
    except asyncpg.InterfaceError as exc:
        # A closed pool or connection ("pool is closing", "connection is closed") is the only way
        # our own code meets InterfaceError outside development.
        raise Unavailable(f"PostgreSQL connection unusable: {_short(exc)}", metadata={"operation": operation}) from None
    except asyncpg.TransactionRollbackError as exc:  # class 40: serialization failure, deadlock
        raise Conflict(f"concurrent update, retry: {_short(exc)}", metadata={"operation": operation}) from None
    except asyncpg.ForeignKeyViolationError:
        # Every foreign key points at a session: it was deleted while this statement ran.
        raise NotFound("session not found", metadata={"operation": operation}) from None
    except (asyncpg.CharacterNotInRepertoireError, asyncpg.UntranslatableCharacterError):
        raise InvalidArgument(
            "text contains a character PostgreSQL cannot store (NUL)", metadata={"operation": operation}
        ) from None
    except asyncpg.PostgresError as exc:
        if operation == "open":
            # Refused by the server when connecting or migrating, not for want of it (those are
            # Unavailable above): a parameter of the URL it does not know, a role that may not
            # create the schema. No retry mends it: ``serve`` stops in one line that says why.
            raise ValueError(f"PostgreSQL refused to open the store: {_short(exc)} (SQLSTATE {exc.sqlstate})") from None
        log.error(
            "store error", extra={"operation": operation, "sqlstate": exc.sqlstate, "error": _short(exc)}, exc_info=exc
        )
        raise Internal(
            f"store error ({exc.sqlstate})", reason="STORE_ERROR", metadata={"operation": operation}
        ) from None
    except asyncpg.InternalClientError as exc:
        # Seen on a pooled connection the server had closed ("cannot switch to state …; another
        # operation is in progress"): the connection is unusable, the pool replaces it.
        log.warning("store connection unusable", extra={"operation": operation, "error": _short(exc)}, exc_info=exc)
        raise Unavailable("PostgreSQL connection unusable", metadata={"operation": operation}) from None
