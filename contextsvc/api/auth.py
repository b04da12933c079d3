"""Who is calling. Until API tokens land (DESIGN §5.10), every caller is the local admin."""

from __future__ import annotations

from typing import Any

import grpc

from contextsvc.core.session import ANONYMOUS, Principal


def caller_of(context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
    """The principal of a call. Ownership is already stored and enforced by every store, so
    turning authentication on changes only this function."""
    return ANONYMOUS
