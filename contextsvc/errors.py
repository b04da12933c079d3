"""Domain errors: one hierarchy, mapped to gRPC statuses only in the API adapter."""

from __future__ import annotations

from collections.abc import Mapping

#: the most characters of a client's value an error message repeats: a message travels in the
#: status's trailers, which clients cap (8 KiB by default), and an id of megabytes echoed whole
#: turned an INVALID_ARGUMENT into the client's own RESOURCE_EXHAUSTED, its reason unreadable.
QUOTED_CHARS = 80


def quoted(value: str) -> str:
    """``value`` as an error message quotes it: ``repr``, cut to ``QUOTED_CHARS`` with an ellipsis."""
    return repr(value if len(value) <= QUOTED_CHARS else value[:QUOTED_CHARS] + "…")


class ContextError(Exception):
    """Root of every error contextsvc raises on purpose."""

    reason: str = "CONTEXT_ERROR"

    def __init__(self, message: str, *, reason: str | None = None, metadata: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})


class NotFound(ContextError):
    """The session (or message) does not exist or belongs to someone else."""

    reason = "NOT_FOUND"


class FieldViolation:
    """One bad field of a request, named by its path (``messages[2].content``)."""

    __slots__ = ("description", "field")

    def __init__(self, field: str, description: str):
        self.field = field
        self.description = description

    def __repr__(self) -> str:
        return f"FieldViolation({self.field!r}, {self.description!r})"


class InvalidArgument(ContextError):
    """The request is malformed; ``violations`` name the offending fields."""

    reason = "INVALID_ARGUMENT"

    def __init__(
        self,
        message: str,
        *,
        violations: list[FieldViolation] | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ):
        super().__init__(message, reason=reason, metadata=metadata)
        self.violations = list(violations or [])

    @classmethod
    def field(cls, field: str, description: str, *, reason: str | None = None) -> InvalidArgument:
        return cls(f"{field}: {description}", violations=[FieldViolation(field, description)], reason=reason)


class RequestIdReused(InvalidArgument):
    """An ``AppendMessages.request_id`` came back with a different body than its first use."""

    reason = "REQUEST_ID_REUSED"

    def __init__(self, request_id: str):
        description = "was already used for a different request in this session; use a new id for new messages"
        super().__init__(
            f"request_id {quoted(request_id)} {description}",
            violations=[FieldViolation("request_id", description)],
            metadata={"request_id": request_id},
        )


class EventIdAhead(InvalidArgument):
    """A ``StreamEvents.after_event_id`` past the newest event: every event up to it would be
    skipped in silence (an id of another fleet's, a clock set back before a restart)."""

    def __init__(self, after_event_id: int, newest: int):
        description = f"{after_event_id} is past the newest event ({newest}); resume from an id this service gave, or 0"
        super().__init__(
            f"after_event_id {description}",
            violations=[FieldViolation("after_event_id", description)],
            metadata={"newest_event_id": str(newest)},
        )


class FailedPrecondition(ContextError):
    """The request is valid but the session's state does not allow it."""

    reason = "FAILED_PRECONDITION"


class NothingToCompact(FailedPrecondition):
    """Compression was asked for but nothing could be removed from the context."""

    reason = "NOTHING_TO_COMPACT"


class ContextTooLarge(FailedPrecondition):
    """The view does not fit the window even after compression."""

    reason = "CONTEXT_TOO_LARGE"


class SessionDamaged(FailedPrecondition):
    """The session's stored history cannot be trusted (lost records): it is read-only until
    an operator repairs it (``contextsvc fsck --repair``)."""

    reason = "SESSION_DAMAGED"


class EventsExpired(FailedPrecondition):
    """A ``StreamEvents`` watcher fell so far behind that events it had not read yet left the
    retained log: resuming cannot give them back, so the stream ends instead of skipping them."""

    reason = "EVENTS_EXPIRED"

    def __init__(self, *, after_event_id: int, lost_event_id: int, oldest_event_id: int):
        super().__init__(
            f"this watcher fell behind by more than the retained events: event {lost_event_id} and "
            f"others it had not read are no longer kept (the oldest kept is {oldest_event_id}); read "
            f"the session again (ListMessages), then resume with after_event_id={after_event_id}",
            metadata={
                "after_event_id": str(after_event_id),
                "lost_event_id": str(lost_event_id),
                "oldest_event_id": str(oldest_event_id),
            },
        )


class Conflict(ContextError):
    """A concurrent operation on the same session got there first."""

    reason = "CONFLICT"


class Unavailable(ContextError):
    """A backing service (store, summarizer) is unreachable; retrying may help."""

    reason = "UNAVAILABLE"


class ResourceExhausted(ContextError):
    """A per-user quota or rate limit was hit; ``retry_after_seconds`` says when to try again."""

    reason = "QUOTA_EXCEEDED"

    def __init__(self, message: str, *, limit: str, subject: str, retry_after_seconds: float):
        super().__init__(message, metadata={"limit": limit, "retry_after_seconds": f"{retry_after_seconds:.3f}"})
        self.limit = limit
        self.subject = subject
        self.retry_after_seconds = retry_after_seconds


class Unimplemented(ContextError):
    """The RPC exists in the contract but its capability has not landed yet."""

    reason = "UNIMPLEMENTED"


class Unauthenticated(ContextError):
    """Credentials are missing or wrong."""

    reason = "UNAUTHENTICATED"


class Internal(ContextError):
    """A fault of the service or its store that no client input caused (mapped to INTERNAL)."""

    reason = "INTERNAL"
