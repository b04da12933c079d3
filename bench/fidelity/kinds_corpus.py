# ruff: noqa: RUF001, E501  (CJK text keeps its own punctuation; templates are one row a line)
"""Message kinds the token benches cover thinly, for ``probe_kinds.py``: built offline, split dev/held.

Kinds: CJK mixed with code and English, emoji-heavy chat, minified JSON, deeply nested JSON,
base64 blobs in tool results, long stack traces, unified diffs, SQL with psql-style results,
markdown tables, very short messages, tool calls with big argument JSON (a file's code escaped
inside it), hex ids and hashes. Each session is a list of *steps* (lists of messages); a view of
step k is the system prompt plus steps 0..k.

Sources: generated from templates here, plus text the machine already has (stdlib modules for
diffs and escaped code, gettext catalogues for CJK fragments, installed packages' JSON). The
split is by source (a stable hash of the file or template index), so no source is in both:
``dev`` is what a fix may be looked at against, ``held`` is reported separately and never tuned on.
"""

from __future__ import annotations

import base64
import difflib
import glob
import hashlib
import json
import random
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from fidelity_corpus import catalog_strings

from contextsvc.core.messages import Message, Role, ToolCall

KINDS = (
    "cjk_mixed",
    "emoji_chat",
    "json_minified",
    "json_deep",
    "base64_tool",
    "stacktrace",
    "diff",
    "sql",
    "md_table",
    "short",
    "toolcall_big",
    "hex_ids",
)
_STDLIB = sysconfig.get_paths()["stdlib"]
_SITE = sysconfig.get_paths()["purelib"]


def _split_of(name: str) -> str:
    return "dev" if int(hashlib.sha1(name.encode()).hexdigest(), 16) % 2 == 0 else "held"


def _read(path: str, limit: int = 40_000) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")[:limit]
    except (OSError, UnicodeDecodeError):
        return ""


@dataclass
class Session:
    kind: str
    system: str
    steps: list[list[Message]]


_SYSTEMS = (
    "You are a careful coding agent. Use the tools; never guess file contents.",
    "You are a helpful assistant for a software team. Answer briefly.",
)

# --- sources -------------------------------------------------------------------------------


def _cjk_fragments(split: str) -> list[str]:
    out: list[str] = []
    for loc in ("zh_CN", "ja", "ko", "zh_TW"):
        for strings in catalog_strings(loc, lambda name: _split_of(name) == split):
            out += [v.strip() for v in strings if 6 <= len(v) <= 120 and not v.isascii() and "%" not in v]
    return out


def _py_files(split: str) -> list[str]:
    return [f for f in sorted(glob.glob(f"{_STDLIB}/*.py")) if _split_of(Path(f).name) == split]


def _json_files(split: str) -> list[object]:
    out: list[object] = []
    for f in sorted(glob.glob(f"{_SITE}/**/*.json", recursive=True))[:400]:
        if _split_of(f) != split:
            continue
        try:
            out.append(json.loads(_read(f, 200_000)))
        except ValueError:
            continue
    return [o for o in out if isinstance(o, (dict, list)) and len(json.dumps(o)) > 400]


_IDENTS = (
    "retry_count",
    "user_id",
    "src/app/main.py",
    "config.yaml",
    "HttpClient",
    "parse_args()",
    "npm run build",
    "max_tokens=4096",
    "docker compose up",
    "feature/login-v2",
    "PR #4821",
    "TypeError",
)
_CJK_GLUE = {
    "dev": ("请把 {i} 改一下，", "我觉得 {i} 有问题：", "{i} のテストが失敗しました。", "{i} 에서 오류가 납니다. "),
    "held": ("麻烦看看 {i} 吧，", "关于 {i}：", "{i} を確認してください。", "{i} 를 다시 실행해 주세요. "),
}

_EMOJI = {
    "dev": "😀😂🥲😍🤔🙏👍🔥✅❌🚀🎉💡⚠️🐛📦🔧👀😅🙌",
    "held": "😎😭🤯🥳😴🤝👎💥✨🛑🚧📌🧪🔍🧵😬🫠🙈💯",
}
_ZWJ = {
    "dev": ("👩‍💻", "👨‍👩‍👧", "🏳️‍🌈", "👍🏽", "🇩🇪", "🧑🏿‍🚀"),
    "held": ("👨‍💻", "👩‍👩‍👦", "🏴‍☠️", "👋🏻", "🇯🇵", "🧑🏾‍🔬"),
}
_CHAT = {
    "dev": (
        "deploy is done",
        "tests are green",
        "who broke main",
        "lunch?",
        "ship it",
        "can you review my PR",
        "build failed again",
        "nice work",
    ),
    "held": (
        "rollback please",
        "CI is flaky",
        "merged",
        "standup in 5",
        "lgtm",
        "the cache is stale",
        "almost there",
        "thanks all",
    ),
}
_SHORT = {
    "dev": ("ok", "yes", "no", "y", "go", "thx", "?", "done", "👍", "k", "sure", "next", "1", "stop"),
    "held": ("okay", "yep", "nope", "n", "continue", "ty", "!", "fine", "🙏", "cool", "again", "2", "wait", "hm"),
}

# --- generators ----------------------------------------------------------------------------


def _user(text: str) -> Message:
    return Message(role=Role.USER, content=text)


def _asst(text: str) -> Message:
    return Message(role=Role.ASSISTANT, content=text)


def _call(rng: random.Random, name: str, args: object, result: str, say: str = "") -> list[Message]:
    cid = f"call_{rng.getrandbits(48):012x}"
    args_json = json.dumps(args, ensure_ascii=False)
    return [
        Message(role=Role.ASSISTANT, content=say, tool_calls=(ToolCall(id=cid, name=name, arguments_json=args_json),)),
        Message(role=Role.TOOL, content=result, tool_call_id=cid, name=name),
    ]


def _cjk_mixed(rng: random.Random, split: str, frags: list[str]) -> list[Message]:
    parts = []
    for _ in range(rng.randint(3, 14)):
        glue = rng.choice(_CJK_GLUE[split]).format(i=rng.choice(_IDENTS))
        parts.append(glue + rng.choice(frags))
        if rng.random() < 0.3:
            parts.append(f" (see `{rng.choice(_IDENTS)}` line {rng.randint(1, 999)})")
    text = "".join(parts)
    if rng.random() < 0.5:
        return [_user(text)]
    return [_user(rng.choice(frags)), _asst(text)]


def _emoji_chat(rng: random.Random, split: str) -> list[Message]:
    out = []
    for _ in range(rng.randint(1, 4)):
        bits = []
        for _ in range(rng.randint(1, 6)):
            bits.append(rng.choice(_CHAT[split]))
            bits.append("".join(rng.choice(_EMOJI[split]) for _ in range(rng.randint(1, 6))))
            if rng.random() < 0.4:
                bits.append(rng.choice(_ZWJ[split]) * rng.randint(1, 3))
        out.append(_user(" ".join(bits)) if rng.random() < 0.6 else _asst(" ".join(bits)))
    return out


def _deep(rng: random.Random, depth: int) -> object:
    if depth == 0:
        return rng.choice([rng.randint(0, 10**6), round(rng.random() * 1000, 3), f"v{rng.randint(0, 99)}", True, None])
    if rng.random() < 0.5:
        return [_deep(rng, depth - 1) for _ in range(rng.randint(1, 3))]
    keys = ("id", "name", "meta", "items", "spec", "status", "children", "labels", "value", "attrs")
    return {rng.choice(keys) + str(rng.randint(0, 9)): _deep(rng, depth - 1) for _ in range(rng.randint(1, 3))}


def _json_minified(rng: random.Random, split: str, docs: list[object]) -> list[Message]:
    doc = rng.choice(docs)
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    start = rng.randrange(0, max(1, len(text) - 3000))
    body = text[start : start + rng.randint(400, 6000)]
    return _call(rng, "http_get", {"url": f"https://api.example.com/v{rng.randint(1, 3)}/items"}, body)


def _json_deep(rng: random.Random, split: str) -> list[Message]:
    doc = _deep(rng, rng.randint(6, 12))
    indent = 2 if split == "dev" else 4
    text = json.dumps({"data": doc, "ok": True}, indent=indent)[:12_000]
    return _call(rng, "describe_resource", {"id": f"res-{rng.randint(1000, 9999)}"}, text)


def _base64_tool(rng: random.Random, split: str, files: list[str]) -> list[Message]:
    raw = (
        zlib.compress(_read(rng.choice(files), 6000).encode())
        if rng.random() < 0.5
        else rng.randbytes(rng.randint(200, 4000))
    )
    b64 = base64.b64encode(raw).decode()
    if rng.random() < 0.5:
        content = json.dumps({"file": f"assets/blob{rng.randint(0, 99)}.bin", "encoding": "base64", "data": b64})
    else:
        content = f"Downloaded {len(raw)} bytes.\ndata:application/octet-stream;base64,{b64}\n"
    return _call(rng, "read_binary", {"path": f"assets/blob{rng.randint(0, 99)}.bin"}, content)


def _stacktrace(rng: random.Random, split: str, files: list[str]) -> list[Message]:
    lines = ["Traceback (most recent call last):"]
    for _ in range(rng.randint(8, 40)):
        f = rng.choice(files)
        src = _read(f, 20_000).splitlines() or ["pass"]
        n = rng.randrange(len(src))
        lines.append(
            f'  File "{f}", line {n + 1}, in {rng.choice(("run", "_call", "handle", "__init__", "dispatch", "<module>"))}'
        )
        lines.append("    " + src[n].strip())
    lines.append(
        rng.choice(
            (
                "KeyError: 'user_id'",
                "ValueError: invalid literal for int() with base 10: 'abc'",
                "ConnectionResetError: [Errno 104] Connection reset by peer",
            )
        )
    )
    if split == "held" or rng.random() < 0.3:
        lines.append("")
        lines.append('Exception in thread "main" java.lang.NullPointerException: Cannot invoke "String.length()"')
        for _ in range(rng.randint(5, 25)):
            pkg = (
                ".".join(rng.choice(("com", "org", "io", "net")) for _ in range(1))
                + "."
                + ".".join(
                    rng.choice(("acme", "core", "service", "impl", "util", "http", "spring", "netty"))
                    for _ in range(rng.randint(2, 4))
                )
            )
            cls = rng.choice(
                ("Handler", "Dispatcher", "RequestProcessor", "ThreadPoolExecutor$Worker", "AbstractChannel")
            )
            lines.append(
                f"\tat {pkg}.{cls}.{rng.choice(('run', 'invoke', 'lambda$0', 'doFilter'))}({cls.split('$')[0]}.java:{rng.randint(10, 2000)})"
            )
    return _call(rng, "run_tests", {"cmd": "pytest -x"}, "\n".join(lines), say="Running the tests.")


def _diff(rng: random.Random, split: str, files: list[str]) -> list[Message]:
    f = rng.choice(files)
    old = _read(f, 30_000).splitlines()
    if len(old) < 20:
        old = old + ["pass"] * 20
    new = list(old)
    for _ in range(rng.randint(2, 8)):
        i = rng.randrange(len(new))
        op = rng.random()
        if op < 0.4:
            new[i] = new[i].replace("self", "this").replace("return", "yield") + "  # changed"
        elif op < 0.7:
            new.insert(
                i,
                "    "
                + rng.choice(
                    ("logger.debug('here')", "assert x is not None", "raise NotImplementedError", "retries += 1")
                ),
            )
        else:
            del new[i]
    name = Path(f).name
    diff = "\n".join(difflib.unified_diff(old, new, f"a/{name}", f"b/{name}", lineterm="", n=3))[:14_000]
    if rng.random() < 0.5:
        return _call(rng, "git_diff", {"path": name}, diff)
    return [_user("Here is my patch, please review:\n```diff\n" + diff + "\n```")]


_TABLES = {"dev": ("orders", "users", "invoices", "events"), "held": ("payments", "accounts", "shipments", "sessions")}


def _sql(rng: random.Random, split: str) -> list[Message]:
    t1, t2 = rng.sample(_TABLES[split], 2)
    q = (
        f"SELECT {t1[0]}.id, {t1[0]}.created_at, {t2[0]}.email, COUNT(*) AS n, SUM({t1[0]}.amount_cents) / 100.0 AS total\n"
        f"FROM {t1} {t1[0]}\nJOIN {t2} {t2[0]} ON {t2[0]}.id = {t1[0]}.{t2[:-1]}_id\n"
        f"WHERE {t1[0]}.created_at >= '2026-0{rng.randint(1, 9)}-01' AND {t1[0]}.status IN ('open', 'paid')\n"
        f"GROUP BY 1, 2, 3\nHAVING COUNT(*) > {rng.randint(1, 5)}\nORDER BY total DESC\nLIMIT {rng.randint(10, 100)};"
    )
    rows = [
        " id   |     created_at      |          email           | n  |  total",
        "------+---------------------+--------------------------+----+---------",
    ]
    for _ in range(rng.randint(3, 40)):
        rows.append(
            f" {rng.randint(1, 99999):>4} | 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} | "
            f"{''.join(rng.choice('abcdefghij') for _ in range(7))}@example.org{'':>6} | {rng.randint(2, 60):>2} | {rng.random() * 10000:>7.2f}"
        )
    rows.append(f"({len(rows) - 2} rows)")
    return _call(rng, "psql", {"query": q}, "\n".join(rows), say="Querying the database.")


def _md_table(rng: random.Random, split: str) -> list[Message]:
    cols = rng.sample(
        ("Name", "Status", "Owner", "Latency p50", "p99", "Errors", "Region", "Version", "Notes"), rng.randint(3, 7)
    )
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if split == "dev" else ":---:" for _ in cols) + "|"]
    for _ in range(rng.randint(3, 30)):
        cells = []
        for c in cols:
            if c in ("Latency p50", "p99"):
                cells.append(f"{rng.random() * 500:.1f} ms")
            elif c == "Errors":
                cells.append(f"{rng.random() * 3:.2f}%")
            elif c == "Version":
                cells.append(f"v{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}")
            elif c == "Status":
                cells.append(rng.choice(("✅ ok", "⚠️ degraded", "❌ down", "ok", "n/a")))
            else:
                cells.append(
                    rng.choice(
                        (
                            "api-gateway",
                            "billing",
                            "auth",
                            "search",
                            "alice",
                            "bob",
                            "eu-west-1",
                            "us-east-2",
                            "retry storm",
                            "—",
                        )
                    )
                )
        lines.append("| " + " | ".join(cells) + " |")
    return [_user("Summarize this status table."), _asst("Here is the status:\n\n" + "\n".join(lines))]


def _short(rng: random.Random, split: str) -> list[Message]:
    return [_user(rng.choice(_SHORT[split])), _asst(rng.choice(_SHORT[split]))]


def _toolcall_big(rng: random.Random, split: str, files: list[str]) -> list[Message]:
    code = _read(rng.choice(files), rng.randint(1500, 12_000))
    args = {
        "path": f"src/{rng.choice(('app', 'lib', 'core'))}/module_{rng.randint(0, 99)}.py",
        "content": code,
        "mode": "overwrite",
    }
    return _call(rng, "write_file", args, json.dumps({"ok": True, "bytes": len(code)}), say="Writing the file.")


def _hex_ids(rng: random.Random, split: str) -> list[Message]:
    lines = []
    for _ in range(rng.randint(5, 60)):
        sha = rng.getrandbits(160).to_bytes(20, "big").hex()
        uid = "-".join(f"{rng.getrandbits(b * 4):0{b}x}" for b in (8, 4, 4, 4, 12))
        lines.append(
            f"{sha} {uid} {rng.choice(('ok', 'missing', 'stale'))}"
            if split == "dev"
            else f"{uid[:8]} {sha[:12]} size={rng.randint(0, 10**7)}"
        )
    return _call(rng, "list_objects", {"bucket": "artifacts"}, "\n".join(lines))


def sessions(split: str, *, count: int = 3, steps: int = 8, seed: int = 20261207) -> dict[str, list[Session]]:
    """``count`` sessions of ``steps`` steps per kind, from ``split``'s sources."""
    frags = _cjk_fragments(split)
    files = _py_files(split)
    docs = _json_files(split)
    makers = {
        "cjk_mixed": lambda r: _cjk_mixed(r, split, frags),
        "emoji_chat": lambda r: _emoji_chat(r, split),
        "json_minified": lambda r: _json_minified(r, split, docs),
        "json_deep": lambda r: _json_deep(r, split),
        "base64_tool": lambda r: _base64_tool(r, split, files),
        "stacktrace": lambda r: _stacktrace(r, split, files),
        "diff": lambda r: _diff(r, split, files),
        "sql": lambda r: _sql(r, split),
        "md_table": lambda r: _md_table(r, split),
        "short": lambda r: _short(r, split),
        "toolcall_big": lambda r: _toolcall_big(r, split, files),
        "hex_ids": lambda r: _hex_ids(r, split),
    }
    out: dict[str, list[Session]] = {}
    for kind in KINDS:
        for k in range(count):
            rng = random.Random(f"{seed}:{split}:{kind}:{k}")
            ss = []
            for i in range(steps):
                step = makers[kind](rng)
                if step[0].role is not Role.USER and i == 0:
                    step = [_user("Please take a look."), *step]
                ss.append(step)
            out.setdefault(kind, []).append(Session(kind, _SYSTEMS[k % 2], ss))
    return out
