"""An independent, deliberately naive statement of the legal-sequence rules, to test the core against.

It walks the list the way a chat API would validate a request, and lists every rule it breaks.
Written without ``contextsvc.core.turns`` / ``legal`` so a bug there cannot hide in both.
"""

from __future__ import annotations

from collections.abc import Sequence

from contextsvc.core.messages import Message, Role


def legality_violations(messages: Sequence[Message]) -> list[str]:
    """Every broken rule of ``messages`` (empty when legal)."""
    lead = 0
    while lead < len(messages) and messages[lead].role is Role.SYSTEM:
        lead += 1
    conv = list(messages[lead:])
    problems: list[str] = []
    if conv and conv[0].role is not Role.USER:
        problems.append(f"conversation starts with {conv[0].role}")
    for k, m in enumerate(conv):
        if m.role is Role.SYSTEM:
            problems.append(f"system row inside the conversation at {k}")
        elif m.role is Role.TOOL:
            head = k - 1
            while head >= 0 and conv[head].role is Role.TOOL:
                head -= 1
            calls = {c.id for c in conv[head].tool_calls} if head >= 0 and conv[head].role is Role.ASSISTANT else set()
            if not m.tool_call_id or m.tool_call_id not in calls:
                problems.append(f"orphan tool result {m.tool_call_id!r} at {k}")
            elif any(r.tool_call_id == m.tool_call_id for r in conv[head + 1 : k]):
                problems.append(f"second answer to {m.tool_call_id!r} at {k}")
        elif m.role is Role.ASSISTANT and m.tool_calls:
            ids = [c.id for c in m.tool_calls]
            if "" in ids or len(set(ids)) != len(ids):
                problems.append(f"malformed call ids {ids} at {k}")
            end = k + 1
            while end < len(conv) and conv[end].role is Role.TOOL:
                end += 1
            missing = set(ids) - {r.tool_call_id for r in conv[k + 1 : end]}
            if missing and k != len(conv) - 1:
                problems.append(f"calls {sorted(missing)} without result at {k}")
    return problems
