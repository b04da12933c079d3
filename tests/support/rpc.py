"""Small helpers for tests that talk to the service with the generated stubs."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r


def user(text: str) -> r.Message:
    return r.Message(role=r.ROLE_USER, content=text)


def assistant(text: str = "", calls: list[tuple[str, str]] | None = None) -> r.Message:
    return r.Message(
        role=r.ROLE_ASSISTANT,
        content=text,
        tool_calls=[r.ToolCall(id=i, name=n, arguments_json='{"q": 1}') for i, n in (calls or [])],
    )


def tool(call_id: str, text: str) -> r.Message:
    return r.Message(role=r.ROLE_TOOL, tool_call_id=call_id, content=text)


def error_details(err: grpc.RpcError) -> dict[str, Any]:
    """Reason, metadata and field violations of a failed call (AIP-193 details)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    out: dict[str, Any] = {"code": err.code(), "message": err.details(), "reason": "", "fields": [], "metadata": {}}
    if status is None:
        return out
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out["reason"] = info.reason
            out["metadata"] = dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out["fields"] = [v.field for v in bad.field_violations]
    return out


def all_messages(stub: Any, session_id: str, buffer: int = pb.BUFFER_DISPLAY, page_size: int = 100) -> list[r.Message]:
    """Every message of a buffer, oldest first, by paging backwards with page tokens."""
    pages: list[list[r.Message]] = []
    token = ""
    for _ in range(100_000):  # bounded; a test session has far fewer pages
        resp = stub.ListMessages(
            pb.ListMessagesRequest(session_id=session_id, buffer=buffer, page_size=page_size, page_token=token)
        )
        pages.append(list(resp.messages))
        if not resp.next_page_token:
            break
        token = resp.next_page_token
    return [m for page in reversed(pages) for m in page]
