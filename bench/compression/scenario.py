"""A deterministic simulated agent session: turns, tool loops, big outputs, images, planted facts.

Everything comes from one ``random.Random(seed)``, so a seed names a session exactly (a finding can
be reproduced with ``--seed``). Text is synthetic (word lists and templates), shaped like what a
coding/ops agent sees: prose asks, code, JSON, logs, directory listings.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

KB = 1024

_WORD_TEXT = (
    "the a of to and in is for on with that this it as be are by from at or an was not we can will "
    "deploy service request cache latency error retry config window token build module handler queue "
    "worker session invoice ledger report customer account payment export import schema table index "
    "migration rollback release branch commit review test failure timeout metric alert dashboard "
    "cluster node pod container image volume secret policy role user group audit log trace span "
    "check verify update fix refactor rename remove add move split merge parse render compute"
)
WORDS = tuple(_WORD_TEXT.split())
IDENTS = ("handler", "worker", "cache", "queue", "ledger", "export", "client", "router", "store", "parser")
TOOLS = ("read_file", "grep", "run_tests", "shell", "http_get", "list_dir", "sql_query")
SYSTEM_PROMPT = (
    "You are an autonomous coding and operations agent. Use the tools to inspect files, run commands "
    "and query services; keep answers short; cite paths and ids exactly."
)


@dataclass(frozen=True)
class Fact:
    """A unique token planted in an early turn; ``query`` is how a runtime might ask for it later."""

    key: str
    token: str
    query: str
    turn: int
    where: str  # ask | answer | tool | tool (middle of a large output)


@dataclass
class ToolResult:
    content: str
    images: list[bytes] = field(default_factory=list)


@dataclass
class Step:
    """One model call that asked for tools, and what the tools returned."""

    calls: list[tuple[str, str, str]]  # (id, name, arguments_json)
    results: list[ToolResult]
    thought: str = ""


@dataclass
class Turn:
    index: int
    ask: str
    ask_images: list[bytes]
    pinned: bool
    steps: list[Step]
    answer: str
    #: the runtime passes the user message as BuildContext's ``incoming`` and appends it after the call.
    incoming: bool


# (key, token, description query, turn, where). Turns are early on purpose: every fact must survive
# hundreds of compactions. Two hide in the middle of a large tool output, beyond any preview.
FACTS: tuple[Fact, ...] = (
    Fact("invoice", "INV-2026-48213", "Acme renewal invoice number", 1, "ask"),
    Fact("path", "/srv/billing/exports/ledger_2026q3_7731.csv", "quarterly ledger export file", 2, "tool"),
    Fact("name", "Margarethe Okonkwo-Lindqvist", "account manager of the Lisbon contract", 4, "ask"),
    Fact("ticket", "OPS-90417", "ticket opened for the payments outage", 5, "answer"),
    Fact("amount", "EUR 18,406.75", "outstanding balance of the Northwind account", 7, "tool"),
    Fact("url", "https://grafana.int.example.net/d/k8s-7f3a9", "latency dashboard link", 9, "tool"),
    Fact("commit", "9f3c2e1a7b5d", "commit that introduced the cache regression", 11, "tool"),
    Fact("uuid", "3b1f6c2e-8d4a-4e7b-9c1d-5a2f0e6b7d84", "tenant id of the staging customer", 13, "ask"),
    Fact("email", "r.hakimi@northwind-logistics.example", "contact email at Northwind Logistics", 16, "answer"),
    Fact(
        "buried-path", "/var/lib/pgdata/base/16384/2619_fsm", "free space map file that was corrupted", 19, "tool-mid"
    ),
    Fact(
        "command",
        "kubectl rollout restart deploy/payments-api-eu",
        "command that restarted the payments api",
        23,
        "ask",
    ),
    Fact("buried-id", "CASE-77120-QX", "support case number for the corrupted free space map", 27, "tool-mid"),
)

PINNED = (
    (
        0,
        "Standing instructions: answer in British English, never run destructive commands "
        "(rm -rf, DROP TABLE) without asking, and always name the files you change.",
    ),
    (
        3,
        "Correction to remember: the deploy target is staging-eu-2 (not staging-eu-1), and the "
        "change freeze starts Friday 18:00 CET.",
    ),
)

_IMAGE_SIZES = ((64, 64), (320, 240), (800, 600), (1024, 1024), (1280, 720), (1920, 1080), (2048, 2048), (3000, 2000))


def png(rng: random.Random, size: tuple[int, int]) -> bytes:
    """A small PNG of the given pixel size: a background and a few boxes (distinct bytes each time)."""
    w, h = size
    img = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        draw.rectangle((x0, y0, min(w - 1, x0 + w // 4), min(h - 1, y0 + h // 4)), fill=rng.randrange(256))
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=1)
    return buf.getvalue()


def prose(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i % 14 == 0 else w)
        if i % 14 == 13:
            out[-1] += "."
    return " ".join(out) + "."


def code(rng: random.Random, chars: int) -> str:
    lines: list[str] = []
    size = 0
    while size < chars:
        name = f"{rng.choice(IDENTS)}_{rng.randrange(1000)}"
        block = (
            f"def {name}(request, timeout={rng.randrange(1, 60)}):\n"
            f"    result = {rng.choice(IDENTS)}.get(request.key, default=None)\n"
            f"    if result is None:\n"
            f"        raise LookupError('missing {rng.choice(WORDS)} for ' + request.key)\n"
            f"    return result\n\n"
        )
        lines.append(block)
        size += len(block)
    return "".join(lines)[:chars]


def json_rows(rng: random.Random, chars: int) -> str:
    rows: list[str] = []
    size = 0
    while size < chars:
        row = json.dumps(
            {
                "id": rng.randrange(10**6),
                "status": rng.choice(("ok", "pending", "failed")),
                "latency_ms": round(rng.random() * 900, 1),
                "node": f"node-{rng.randrange(40)}",
                "note": " ".join(rng.choice(WORDS) for _ in range(6)),
            }
        )
        rows.append(row)
        size += len(row) + 2
    return "[" + ",\n".join(rows) + "]"


def log_lines(rng: random.Random, chars: int) -> str:
    lines: list[str] = []
    size = 0
    while size < chars:
        level = rng.choice(("INFO", "INFO", "INFO", "WARN", "ERROR"))
        line = (
            f"2026-11-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z {level} "
            f"{rng.choice(IDENTS)}[{rng.randrange(9000)}] {' '.join(rng.choice(WORDS) for _ in range(9))}"
        )
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def tool_output(rng: random.Random, chars: int) -> str:
    kind = rng.choice((code, json_rows, log_lines, log_lines))
    return kind(rng, chars)


def _result_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.72:
        return rng.randrange(200, 2 * KB)
    if r < 0.92:
        return rng.randrange(2 * KB, 20 * KB)
    return rng.randrange(20 * KB, 200 * KB)  # the big ones: file dumps, logs, query results


def _steps(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.25:
        return 0
    if r < 0.50:
        return 1
    if r < 0.80:
        return rng.randrange(2, 4)
    if r < 0.95:
        return rng.randrange(4, 9)
    return rng.randrange(9, 21)  # a long tool loop: mid-turn builds


def _args(rng: random.Random, name: str) -> str:
    target = f"src/{rng.choice(IDENTS)}/{rng.choice(IDENTS)}_{rng.randrange(500)}.py"
    args = {
        "read_file": {"path": target},
        "grep": {"pattern": rng.choice(WORDS), "path": "src/"},
        "run_tests": {"selector": f"tests/test_{rng.choice(IDENTS)}.py"},
        "shell": {"cmd": f"make {rng.choice(('lint', 'build', 'check'))}"},
        "http_get": {"url": f"http://127.0.0.1:8080/{rng.choice(IDENTS)}"},
        "list_dir": {"path": "src/"},
        "sql_query": {"sql": f"select * from {rng.choice(IDENTS)} limit 50"},
        "screenshot": {"url": "http://127.0.0.1:3000/"},
    }[name]
    return json.dumps(args)


def _plant(text: str, fact: Fact) -> str:
    sentence = f" Note: the {fact.query} is {fact.token}. "
    if fact.where == "tool-mid":
        middle = len(text) // 2
        return text[:middle] + "\n" + sentence + "\n" + text[middle:]
    return text + sentence


def generate(turns: int, seed: int) -> Iterator[Turn]:
    """The session, turn by turn, generated lazily (a 200 KB output lives only while its turn is played)."""
    rng = random.Random(seed)
    facts = {f.turn: f for f in FACTS if f.turn < turns}
    pinned = dict(PINNED)
    call_no = 0
    for t in range(turns):
        fact = facts.get(t)
        ask = pinned.get(t) or f"Turn {t}: " + prose(rng, rng.randrange(8, 60))
        ask_images = (
            [png(rng, rng.choice(_IMAGE_SIZES)) for _ in range(rng.randrange(1, 3))] if rng.random() < 0.05 else []
        )
        n_steps = _steps(rng)
        if fact is not None and fact.where.startswith("tool"):
            n_steps = max(n_steps, 1)
        steps: list[Step] = []
        for s in range(n_steps):
            calls = []
            results = []
            for _ in range(1 if rng.random() < 0.8 else rng.randrange(2, 4)):
                call_no += 1
                name = "screenshot" if rng.random() < 0.02 else rng.choice(TOOLS)
                calls.append((f"call_{call_no}", name, _args(rng, name)))
                if name == "screenshot":
                    results.append(ToolResult("screenshot attached", [png(rng, rng.choice(_IMAGE_SIZES))]))
                else:
                    size = (
                        rng.randrange(40 * KB, 160 * KB)
                        if fact is not None and fact.where == "tool-mid"
                        else _result_size(rng)
                    )
                    results.append(ToolResult(tool_output(rng, size)))
            if fact is not None and fact.where.startswith("tool") and s == 0:
                results[0].content = _plant(results[0].content, fact)
            thought = prose(rng, rng.randrange(0, 20)) if rng.random() < 0.4 else ""
            steps.append(Step(calls, results, thought))
        answer = prose(rng, rng.randrange(10, 120))
        if fact is not None and fact.where == "ask":
            ask = _plant(ask, fact)
        if fact is not None and fact.where == "answer":
            answer = _plant(answer, fact)
        yield Turn(t, ask, ask_images, t in pinned, steps, answer, incoming=rng.random() < 0.25)
