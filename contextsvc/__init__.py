"""contextsvc: a gRPC service that owns an agent's conversation context."""

from contextsvc.errors import (
    Conflict,
    ContextError,
    ContextTooLarge,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    NothingToCompact,
    Unavailable,
)

__version__ = "0.1.0"

__all__ = [
    "Conflict",
    "ContextError",
    "ContextTooLarge",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "NothingToCompact",
    "Unavailable",
    "__version__",
]
