"""Concurrent agents on every store: no turn fails because an estimate is inflated, and no view is
over ``window - reserve`` in true tokens (issue #14).

    python bench/fidelity/soak.py                               # memory, files, postgres; 40 agents, 120 s each
    python bench/fidelity/soak.py --stores postgres --seconds 360
    python bench/fidelity/soak.py --record                      # and write "## Fidelity: concurrent soak"
    python bench/fidelity/soak.py --stores memory --window 8192 --reserve 1024 --long-every 4
                                                                # long tool results, cut in the view

One real ``contextsvc serve`` per store, over loopback. Each agent owns one session on a profile
with a 16,384-token window and 2,048 tokens reserved for the reply (14,336 for the prompt), its
model one of the four the fidelity bench counts with (gpt-4o, gpt-4, llama-3-8b, claude-2, in
turn). A turn appends one step of a conversation from the fidelity corpus (a question, a tool
call, the tool's output, an answer: 300-2,400 characters of prose, code, JSON, shell output,
Cyrillic/CJK or a mix), builds the context, counts the messages it was served with the model's
real tokenizer (the ChatML-like rendering and frame tokens of bench/tokens), and reports that count
with ``RecordBaseline``. One baseline in three is reported late, after the agent's next append —
as an agent with a slow model would — so the service must price exactly the view the baseline
names, not the session as it is now.

Counted per store: turns, ``CONTEXT_TOO_LARGE`` and every other error, views whose true size is
over ``window - reserve``, baselines refused as truncated (every count here is honest), the
largest true view, and the largest true view over the service's own estimate for it. The corpus
is the fidelity bench's SCORE split; nothing is fitted here.

``--long-every N``: every Nth step's tool results are long (~36,000 characters: the outputs of the
conversation's other steps, joined), so views send them cut to the per-message budget and each
refit may cut them elsewhere. Counted besides: views whose true size is over the estimate plus its
margin.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "bench" / "tokens"))
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from fidelity_corpus import Session, sessions  # noqa: E402
from run import FRAME_PER_MESSAGE, FRAME_PER_PROMPT, ensure_node_deps, render  # noqa: E402

from contextsvc._gen.v1 import context_service_pb2 as pb  # noqa: E402
from contextsvc._gen.v1 import context_service_pb2_grpc as pb_grpc  # noqa: E402
from contextsvc._gen.v1 import resources_pb2 as rpb  # noqa: E402
from contextsvc.client import error_from_rpc  # noqa: E402
from contextsvc.core.messages import Message, Role, ToolCall  # noqa: E402
from contextsvc.errors import ContextTooLarge  # noqa: E402
from tests.support.server import StoreServer  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Fidelity: concurrent soak"
WINDOW = 16_384
RESERVE = 2_048
#: tokenizer (bench/tokens) -> the model name the service maps to that family.
MODELS = {"o200k": "gpt-4o", "cl100k": "gpt-4", "llama3": "llama-3-8b", "claude": "claude-2"}
LATE_EVERY = 3
#: --diagnose: the server logs at INFO, and its lines about a failed session are printed.
DIAGNOSE = False
#: --long-every: every Nth step's tool results are made about this long (0: never)
LONG_EVERY = 0
LONG_CHARS = 36_000
#: the load average (1 min) at the start of each store's run, for the record.
LOADS = ""
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def server_config() -> str:
    blocks = []
    for tokenizer, model in MODELS.items():
        blocks.append(
            f'[profiles.soak-{tokenizer}]\nmodel = "{model}"\ncontext_window = {WINDOW}\n'
            f"output_reserve_tokens = {RESERVE}\n"
        )
    return "\n".join(blocks)


# --- true counts -----------------------------------------------------------------------------------


class Counter:
    """Real token counts from one long-lived node process (bench/tokens/count_lines.mjs), each
    distinct text counted once per tokenizer."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._known: dict[tuple[str, str], int] = {}

    async def start(self) -> None:
        node = shutil.which("node")
        if node is None:
            sys.exit("node is required for the real tokenizers")
        self._proc = await asyncio.create_subprocess_exec(
            node,
            str(ROOT / "bench" / "tokens" / "count_lines.mjs"),
            cwd=ROOT / "bench" / "tokens",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 << 20,
        )

    async def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            await asyncio.wait_for(self._proc.wait(), 30)

    async def counts(self, tokenizer: str, texts: list[str]) -> list[int]:
        missing = sorted({t for t in texts if (tokenizer, t) not in self._known})
        if missing:
            async with self._lock:
                assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
                self._proc.stdin.write(json.dumps({"t": tokenizer, "x": missing}).encode() + b"\n")
                await self._proc.stdin.drain()
                line = await self._proc.stdout.readline()
            for text, n in zip(missing, json.loads(line), strict=True):
                self._known[(tokenizer, text)] = n
        return [self._known[(tokenizer, t)] for t in texts]

    async def prompt(self, tokenizer: str, messages: list[Message]) -> int:
        counts = await self.counts(tokenizer, [render(m) for m in messages])
        return sum(counts) + FRAME_PER_MESSAGE * len(counts) + FRAME_PER_PROMPT


_ROLES = {
    rpb.ROLE_SYSTEM: Role.SYSTEM,
    rpb.ROLE_USER: Role.USER,
    rpb.ROLE_ASSISTANT: Role.ASSISTANT,
    rpb.ROLE_TOOL: Role.TOOL,
}


def from_pb(m: rpb.Message) -> Message:
    """What the model is sent of a served message (for rendering only)."""
    calls = tuple(ToolCall(c.id, c.name, c.arguments_json) for c in m.tool_calls)
    return Message(
        role=_ROLES[m.role],
        content=m.content,
        tool_calls=calls,
        tool_call_id=m.tool_call_id,
        name=m.name,
        thinking=m.thinking,
    )


def to_pb(m: Message) -> rpb.Message:
    return rpb.Message(
        role={v: k for k, v in _ROLES.items()}[m.role],
        content=m.content,
        tool_calls=[rpb.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json) for c in m.tool_calls],
        tool_call_id=m.tool_call_id,
        name=m.name,
    )


# --- the agents ------------------------------------------------------------------------------------


@dataclass
class Tally:
    turns: int = 0
    builds: int = 0
    too_large: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    over_window: int = 0
    refused: int = 0
    baselines: int = 0
    late: int = 0
    largest_true: int = 0
    worst_under: int = 0  # largest true - estimate (tokens the estimate missed)
    over_margin: int = 0  # views whose true size is over the estimate plus its margin
    cut_views: int = 0  # views that sent a row cut to the per-message budget
    compressions: int = 0
    #: the first few failures' messages, printed after the table.
    examples: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    #: views over window - reserve in true tokens: what the service said about each.
    over: list[str] = field(default_factory=list)
    server_log: str = ""

    def error(self, code: str, detail: str = "") -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        self.example(f"{code}: {detail}")

    def example(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(text)


async def agent(
    stub: Any, counter: Counter, tally: Tally, convo: Session, tokenizer: str, deadline: float, seed: int
) -> None:
    rng = random.Random(seed)
    sid = (await stub.CreateSession(pb.CreateSessionRequest(profile_id=f"soak-{tokenizer}", name="soak"))).id
    await stub.AppendMessages(
        pb.AppendMessagesRequest(session_id=sid, messages=[rpb.Message(role=rpb.ROLE_SYSTEM, content=convo.system)])
    )
    pending: tuple[str, int] | None = None  # a baseline held back until after the next append
    step = 0
    outputs = [m.content for turn in convo.steps for m in turn if m.role is Role.TOOL and m.content]
    while time.monotonic() < deadline:
        messages = convo.steps[step % len(convo.steps)]
        step += 1
        if LONG_EVERY and step % LONG_EVERY == 0 and outputs:
            messages = [long_result(m, outputs, rng) if m.role is Role.TOOL else m for m in messages]
        try:
            await stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[to_pb(m) for m in messages]))
            if pending is not None:
                await baseline(stub, tally, sid, *pending)
                tally.late += 1
                pending = None
            built = await stub.BuildContext(pb.BuildContextRequest(session_id=sid))
        except grpc.aio.AioRpcError as exc:
            if isinstance(error_from_rpc(exc), ContextTooLarge):
                tally.too_large += 1
                # What a retry right away gets tells a passing race from a context that cannot fit.
                try:
                    again = await stub.BuildContext(pb.BuildContextRequest(session_id=sid))
                    retry = f"a retry got {again.estimate.total} (compressed: {again.compression.compressed})"
                except grpc.aio.AioRpcError as exc2:
                    retry = f"a retry failed too: {exc2.details()}"
                tally.example(f"CONTEXT_TOO_LARGE on {sid}: {exc.details()}; {retry}")
                tally.failed.append(sid)
            else:
                tally.error(exc.code().name, exc.details() or "")
            continue
        tally.builds += 1
        if built.HasField("compression") and built.compression.compressed:
            tally.compressions += 1
        true = await counter.prompt(tokenizer, [from_pb(m) for m in built.messages])
        tally.largest_true = max(tally.largest_true, true)
        tally.worst_under = max(tally.worst_under, true - built.estimate.total)
        tally.over_margin += true > built.estimate.total + built.estimate.margin
        tally.cut_views += any("chars cut …]" in m.content for m in built.messages)
        if true > WINDOW - RESERVE:
            tally.over_window += 1
            est = built.estimate
            tally.over.append(
                f"view over on {sid}: true {true:,}, estimate {est.total:,} + margin {est.margin:,} "
                f"({rpb.EstimateMethod.Name(est.method)}), "
                f"compressed {built.compression.compressed if built.HasField('compression') else False}, "
                f"notices {list(built.notices)}"
            )
            tally.failed.append(sid)
        if rng.randrange(LATE_EVERY) == 0:
            pending = (built.view_id, true)
        else:
            await baseline(stub, tally, sid, built.view_id, true)
        tally.turns += 1


def long_result(m: Message, outputs: list[str], rng: random.Random) -> Message:
    """``m`` with a ~``LONG_CHARS``-character result: its own, then the conversation's other
    outputs in a random order, joined (each a different text: a file, a log, a listing)."""
    parts = [m.content]
    size = len(m.content)
    while size < LONG_CHARS:
        text = outputs[rng.randrange(len(outputs))]
        parts.append(text)
        size += len(text) + 1
    return Message(role=m.role, content="\n".join(parts), tool_call_id=m.tool_call_id, name=m.name)


async def baseline(stub: Any, tally: Tally, sid: str, view_id: str, count: int) -> None:
    try:
        got = await stub.RecordBaseline(pb.RecordBaselineRequest(session_id=sid, view_id=view_id, prompt_tokens=count))
    except grpc.aio.AioRpcError as exc:
        tally.error(f"RecordBaseline {exc.code().name}", exc.details() or "")
        return
    tally.baselines += 1
    if got.truncated:
        tally.refused += 1


# --- one store -------------------------------------------------------------------------------------


async def soak(store: str, *, agents: int, seconds: float, convos: list[Session]) -> Tally:
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="contextsvc-soak-") as tmp:
        level = "INFO" if DIAGNOSE else "WARNING"
        served = StoreServer(store, Path(tmp), server_config(), ["--log-level", level])
        counter = Counter()
        await counter.start()
        try:
            async with grpc.aio.insecure_channel(served.address, options=OPTIONS) as channel:
                stub = pb_grpc.ContextServiceStub(channel)
                deadline = time.monotonic() + seconds
                tokenizers = list(MODELS)
                await asyncio.gather(
                    *(
                        agent(stub, counter, tally, convos[k % len(convos)], tokenizers[k % 4], deadline, k)
                        for k in range(agents)
                    )
                )
        finally:
            await counter.close()
            served.stop()
            if DIAGNOSE:
                tally.server_log = served.proc.stderr_text
    return tally


def row(store: str, t: Tally, seconds: float) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in sorted(t.errors.items())) or "0"
    return (
        f"| {store} | {t.turns:,} ({t.turns / seconds:.1f}/s) | {t.compressions:,} | **{t.too_large}** | {errors} "
        f"| **{t.over_window}** | {t.largest_true:,} | {t.worst_under:+,} | {t.over_margin:,} of {t.builds:,} "
        f"({t.cut_views:,} with a cut row) | {t.refused} of {t.baselines:,} ({t.late:,} late) |"
    )


HEADER = [
    "| store | turns | compactions a build reported | CONTEXT_TOO_LARGE | other errors "
    "| views over window - reserve (true) | largest true view | most tokens over the estimate "
    "| views over estimate + margin (true) | baselines refused |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def record(lines: list[str], command: str) -> None:
    text = RESULTS.read_text(encoding="utf-8")
    body = "\n".join(
        [
            SECTION,
            "",
            f"{dt.date.today().isoformat()} · `{command}` · {platform.machine()}, {platform.python_version()}, "
            f"{os.cpu_count()} cores · load average (1 min) at the start of each store's run: {LOADS}",
            "",
            *lines,
            "",
        ]
    )
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(text, encoding="utf-8")


def main() -> None:
    global DIAGNOSE, WINDOW, RESERVE, LONG_EVERY
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="memory,files,postgres")
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--window", type=int, default=WINDOW, help="the profiles' context window")
    parser.add_argument("--reserve", type=int, default=RESERVE, help="tokens reserved for the reply")
    parser.add_argument("--long-every", type=int, default=0, help="every Nth step's tool results ~36,000 chars")
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="server at INFO; print its lines about failed sessions and views over the budget",
    )
    args = parser.parse_args()
    DIAGNOSE = args.diagnose
    WINDOW, RESERVE, LONG_EVERY = args.window, args.reserve, args.long_every
    ensure_node_deps()
    by_category = sessions("score", count=8, steps=40)
    convos = [s for group in zip(*by_category.values(), strict=True) for s in group]  # categories interleaved
    lines = [
        f"{args.agents} agents, window {WINDOW:,} with {RESERVE:,} reserved ({WINDOW - RESERVE:,} for the prompt), "
        f"{args.seconds:.0f} s per store; one baseline in {LATE_EVERY} reported after the next append"
        + (f"; every {LONG_EVERY}th step's tool results ~{LONG_CHARS:,} characters." if LONG_EVERY else "."),
        "",
        *HEADER,
    ]
    ok = True
    loads = []
    for store in args.stores.split(","):
        loads.append(f"{store} {os.getloadavg()[0]:.1f}")
        tally = asyncio.run(soak(store, agents=args.agents, seconds=args.seconds, convos=convos))
        lines.append(row(store, tally, args.seconds))
        print(lines[-1], flush=True)
        for text in tally.examples:
            print(f"  {store}: {text}", flush=True)
        for text in tally.over[:5]:
            print(f"  {store}: {text}", flush=True)
        for sid in tally.failed[:3]:
            # The newest lines about the session (a long session logs a line per compaction).
            for line in [line for line in tally.server_log.splitlines() if sid in line][-12:]:
                print(f"  {store} log: {line[:400]}", flush=True)
        ok = ok and tally.too_large == 0 and tally.over_window == 0 and tally.refused == 0 and not tally.errors
    verdict = "met" if ok else "NOT met"
    lines += ["", f"Targets (0 CONTEXT_TOO_LARGE, 0 views over, 0 honest baselines refused): {verdict}."]
    print("\n".join(lines))
    global LOADS
    LOADS = ", ".join(loads)
    print(f"load average (1 min) at the start of each store's run: {LOADS}")
    if args.record:
        record(lines, "python bench/fidelity/soak.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
