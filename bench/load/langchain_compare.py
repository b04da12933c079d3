"""In process: building a 200-message view vs LangChain's ``trim_messages`` on the same messages.

    python bench/load/langchain_compare.py             # print the table
    python bench/load/langchain_compare.py --record    # and write it into bench/RESULTS.md

LangChain runs in its own virtual environment (``bench/load/.build/langchain-venv``, created on
the first run with ``pip install langchain-core``), fed the same 200 messages as JSON; both sides
are timed in the same run, their rounds interleaved (one LangChain round, then one round of each of
ours), best of several rounds of many calls.

Our side is ``ViewService.assemble`` (legal view, per-message cuts, image budget, calibrated
estimate with its segments) in three states: *cold* (every message a new object: nothing sized
yet), *warm* (the stored messages, sized once each, the view assembled again: a build after a
change), *extended* (the session's view memo holds the view of the first 196 messages and the newest agent step,
a user message, a tool call, its output and the answer, was appended since: the usual build of a
turn, ``ViewService._extended``), *reused* (the session's view memo: a build with nothing new).
LangChain's side is
``trim_messages(strategy="last", token_counter=count_tokens_approximately)`` with a budget that
keeps every message, which counts every message on every call, as our cold and warm builds do.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import venv
from pathlib import Path
from collections.abc import Callable
from typing import Any

import _checkout  # noqa: F401 - this checkout's contextsvc
from google.protobuf import json_format
from workload import messages

from contextsvc.api import mapping
from contextsvc.config import ProfileConfig, Settings
from contextsvc.core.messages import Role
from contextsvc.core.profile import ProfileOverrides, resolve_profile
from contextsvc.core.session import ANONYMOUS
from contextsvc.engine.engine import Engine
from contextsvc.engine.state import EngineState
from contextsvc.events.memory_bus import MemoryEventBus
from contextsvc.stores.memory import MemoryStore
from contextsvc.summarizers.registry import build_summarizers

HERE = Path(__file__).resolve().parent
VENV = HERE / ".build" / "langchain-venv"
N = 200
#: messages of one agent step (ask, tool call, tool output, answer): what a turn appends
STEP = 4
WINDOW = 4_000_000

LANGCHAIN_SIDE = r"""
import json, sys, time
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, SystemMessage
from langchain_core.messages.utils import count_tokens_approximately, trim_messages

rows = json.load(open(sys.argv[1]))
calls = int(sys.argv[2])
msgs = []
for r in rows:
    role = r.get("role")
    content = r.get("content", "")
    if role == "ROLE_USER":
        msgs.append(HumanMessage(content))
    elif role == "ROLE_TOOL":
        msgs.append(ToolMessage(content, tool_call_id=r.get("toolCallId", "")))
    else:
        calls_ = [
            {"id": c["id"], "name": c["name"], "args": json.loads(c.get("argumentsJson") or "{}")}
            for c in r.get("toolCalls", [])
        ]
        msgs.append(AIMessage(content, tool_calls=calls_))
msgs.insert(0, SystemMessage("You are a helpful agent."))
import langchain_core
# One round of ``calls`` per line read, so the caller interleaves these rounds with its own.
for _ in sys.stdin:
    t = time.perf_counter()
    for _ in range(calls):
        out = trim_messages(msgs, max_tokens=4_000_000 - 2048, token_counter=count_tokens_approximately,
                            strategy="last", include_system=True, start_on="human")
    seconds = (time.perf_counter() - t) / calls
    print(json.dumps({"seconds": seconds, "kept": len(out), "version": langchain_core.__version__}), flush=True)
"""


def langchain_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "langchain-core>=1,<2"], check=True, timeout=900)
    return python


async def ours(rounds: int, calls: int, other_round: Callable[[], None]) -> dict[str, Any]:
    """Best per-call time of each of our states; ``other_round`` (LangChain's side) runs one
    round before each of ours, so both sides see the same moments of a shared machine."""
    settings = Settings(profiles={"default": ProfileConfig(model="bench", context_window=WINDOW)}, store="memory")
    store = MemoryStore(settings)
    await store.open()
    bus = MemoryEventBus(retention=100)
    summarizers = build_summarizers(settings)
    engine = Engine(store=store, bus=bus, settings=settings, clock=_Clock(), summarizers=summarizers)
    session = await engine.sessions.create(ANONYMOUS, profile_id="", name="", metadata={})
    incoming = [mapping.incoming_from_pb(m, f"messages[{i}]") for i, m in enumerate(messages(N))]
    await engine.append(ANONYMOUS, session.id, incoming, request_id="", turn_complete=False)
    profile = resolve_profile(settings, "", ProfileOverrides(system_prompt="You are a helpful agent."))
    await engine.accounting.ensure_loaded(profile.model)
    context = await store.load_context(session.id, caller=ANONYMOUS)
    state = EngineState.of(await store.get_session(session.id, caller=ANONYMOUS))
    views = engine.views

    # New objects for every cold call (no per-message memo applies), made before the clock starts:
    # copying is the bench's work, not the build's.
    copies = iter([[dataclasses.replace(m) for m in context] for _ in range(rounds * calls)])

    def cold() -> None:
        views.assemble(profile, next(copies), None, state)

    def warm() -> None:
        views.assemble(profile, context, None, state)

    def reused() -> None:
        views.assemble(profile, context, None, state, session_id=session.id)

    # The view of all but the newest agent step, as the memo keeps it after the previous turn's build.
    step = N - STEP
    assert context[step].role is Role.USER, "the newest step must start at a user message"
    views.assemble(profile, context[:step], None, state, session_id=session.id)
    kept = views._memo.same_rows(session.id, context[:step])  # the bench sets the memo up
    assert kept is not None
    kept_key, kept_view = kept

    def extended() -> None:
        views._memo.put(session.id, kept_key, context[:step], kept_view)
        views.assemble(profile, context, None, state, session_id=session.id)

    extended()
    grown = views.assemble(profile, context, None, state, session_id=session.id)
    if grown.rows != views.assemble(profile, context, None, state).rows:
        raise AssertionError("the extended view differs from a fresh assembly")
    out: dict[str, Any] = {"rows": len(views.assemble(profile, context, None, state).rows)}
    states = (("cold", cold), ("warm", warm), ("extended", extended), ("reused", reused))
    for name, _ in states:
        out[name] = float("inf")
    for _ in range(rounds):
        other_round()
        for name, fn in states:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name] = min(out[name], (time.perf_counter() - t) / calls)
    return out


class _Clock:
    def now(self) -> Any:
        import datetime as dt

        return dt.datetime.now(dt.UTC)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    python = langchain_python()
    data = HERE / ".build" / "langchain-messages.json"
    data.write_text(json.dumps([json_format.MessageToDict(m) for m in messages(N)]))
    script = HERE / ".build" / "langchain_side.py"
    script.write_text(LANGCHAIN_SIDE)
    side = subprocess.Popen(
        [str(python), str(script), str(data), str(args.calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert side.stdin is not None and side.stdout is not None
    lc: dict[str, Any] = {"seconds": float("inf")}

    def langchain_round() -> None:
        assert side.stdin is not None and side.stdout is not None
        side.stdin.write("\n")
        side.stdin.flush()
        line = side.stdout.readline()
        if not line:
            raise RuntimeError("the LangChain side ended early")
        got = json.loads(line)
        lc.update(got, seconds=min(lc["seconds"], got["seconds"]))

    try:
        ours_out = asyncio.run(ours(args.rounds, args.calls, langchain_round))
    finally:
        side.stdin.close()
        side.wait(timeout=60)
    lines = [
        "| what | µs per call | / LangChain trim_messages |",
        "|---|---|---|",
        f"| LangChain {lc['version']} `trim_messages` + `count_tokens_approximately` ({lc['kept']} kept) "
        f"| {lc['seconds'] * 1e6:,.0f} | 1.00 |",
    ]
    for name in ("cold", "warm", "extended", "reused"):
        lines.append(
            f"| contextsvc `assemble`, {name} ({ours_out['rows']} rows) | {ours_out[name] * 1e6:,.0f} "
            f"| {ours_out[name] / lc['seconds']:.2f} |"
        )
    print("\n".join(lines))
    if args.record:
        record(lines, args)


def record(lines: list[str], args: argparse.Namespace) -> None:
    path = HERE.parent / "RESULTS.md"
    text = path.read_text()
    title = "### In process: a 200-message view vs LangChain trim_messages"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    block = "\n".join(
        [
            title,
            "",
            f"- date: {time.strftime('%Y-%m-%d')}; machine: {os.cpu_count()} cores (nproc), Python "
            f"{platform.python_version()}; commit: {head.stdout.strip()}; best of {args.rounds} rounds of "
            f"{args.calls} calls each side",
            "- command: `python bench/load/langchain_compare.py --record`",
            "",
            *lines,
            "",
        ]
    )
    if title in text:
        start = text.index(title)
        end = text.find("\n### ", start + 1)
        end2 = text.find("\n## ", start + 1)
        ends = [e for e in (end, end2) if e != -1]
        stop = min(ends) + 1 if ends else len(text)
        text = text[:start] + block + text[stop:]
    else:
        start = text.index("## Load\n")
        nxt = text.find("\n## ", start + 1)
        at = nxt + 1 if nxt != -1 else len(text)
        text = text[:at].rstrip("\n") + "\n\n" + block + "\n" + text[at:]
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
