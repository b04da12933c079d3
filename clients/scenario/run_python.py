"""Runs clients/scenario/scenario.json with the Python client; writes the transcript as JSON.

python3 clients/scenario/run_python.py 127.0.0.1:50051 transcript.json
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from contextsvc.client import ContextClient

SCENARIO = Path(__file__).with_name("scenario.json")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "images": [base64.b64decode(i) for i in m.get("images", [])]} for m in raw]


async def run(address: str) -> list[dict[str, Any]]:
    steps = json.loads(SCENARIO.read_text())["steps"]
    transcript: list[dict[str, Any]] = []
    sid, view_id, summary_seq = "", "", 0
    async with ContextClient(address, timeout=30) as c:
        for step in steps:
            op, a = step["op"], step["args"]
            result: Any
            if op == "create_session":
                result = await c.create_session(name=a["name"], metadata=a["metadata"])
                sid = result["id"]
            elif op == "append_messages":
                result = await c.append_messages(sid, _messages(a["messages"]), turn_complete=a["turn_complete"])
            elif op == "build_context":
                result = await c.build_context(
                    sid, profile=a["profile"], auto_compress=a["auto_compress"], incoming=a.get("incoming")
                )
                view_id = result["view_id"]
            elif op == "record_baseline":
                result = await c.record_baseline(sid, view_id, a["prompt_tokens"])
            elif op == "compress":
                result = await c.compress(sid, profile=a["profile"], reason=a["reason"])
            elif op == "events":
                result = []
                async for event in c.events(sid, after_event_id=a["after_event_id"]):
                    result.append(event)
                    if event["payload"] == a["until"]:
                        summary_seq = event["context_compressed"]["summary_sequence"]
                        break
            elif op == "list_messages":
                result = await c.list_messages(sid, buffer=a["buffer"])
            elif op == "search_history":
                result = await c.search_history(sid, a["query"], limit=a["limit"])
            elif op == "expand_summary":
                result = await c.expand_summary(sid, summary_seq)
            elif op == "fork_session":
                result = await c.fork_session(sid, at_sequence=a["at_sequence"])
                sid = result["id"]
            else:
                raise ValueError(f"unknown op {op!r}")
            transcript.append({"op": op, "result": _jsonable(result)})
    return transcript


def main() -> int:
    address, out = sys.argv[1], Path(sys.argv[2])
    out.write_text(json.dumps(asyncio.run(asyncio.wait_for(run(address), 120)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
