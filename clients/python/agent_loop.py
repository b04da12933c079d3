"""A minimal agent loop on contextsvc with a local fake model (no network besides the service).

python3 clients/python/agent_loop.py 127.0.0.1:50051
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from contextsvc.client import ContextClient, TLSOptions

PROFILE = {"model": "fake-model", "context_window": 8192, "system_prompt": "You are a coding agent."}


def fake_model(messages: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """Asks for one tool call, then answers; reports prompt tokens like a provider would."""
    prompt_tokens = sum(len(m["content"]) for m in messages) // 4 + 3 * len(messages)
    last = messages[-1]
    if last["role"] == "user":
        call = {"id": "call-1", "name": "read_file", "arguments_json": json.dumps({"path": "main.py"})}
        return {"role": "assistant", "content": "", "tool_calls": [call]}, prompt_tokens
    return {"role": "assistant", "content": f"main.py has {len(last['content'])} characters."}, prompt_tokens


async def main(address: str, ca_pem: bytes | None) -> None:
    tls = TLSOptions(root_certificates=ca_pem) if ca_pem else False
    async with ContextClient(address, token=os.environ.get("CONTEXTSVC_TOKEN"), tls=tls) as client:
        sid = (await client.create_session(name="agent-loop"))["id"]
        await client.append_messages(sid, [{"role": "user", "content": "How long is main.py?"}])
        phase = "pre_turn"
        for _ in range(8):  # bounded: at most 8 model calls in this turn
            view = await client.build_context(sid, profile=PROFILE, phase=phase)
            reply, prompt_tokens = fake_model(view["messages"])
            await client.record_baseline(sid, view["view_id"], prompt_tokens)
            phase = "mid_turn"
            if not reply.get("tool_calls"):
                await client.append_messages(sid, [reply], turn_complete=True)
                print("answer:", reply["content"])
                break
            result = {"role": "tool", "tool_call_id": "call-1", "content": "print('hello')\n"}
            await client.append_messages(sid, [reply, result])
        messages = (await client.list_messages(sid))["messages"]
        print("done:", len(messages), "messages in the display history")


if __name__ == "__main__":
    ca_file = os.environ.get("CONTEXTSVC_CA_FILE")
    ca = Path(ca_file).read_bytes() if ca_file else None
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051", ca))
