# ruff: noqa: RUF001, E501  (a Chinese sentence keeps its own punctuation; the sources table is one row a line)
"""The fidelity corpus: agent sessions in six categories, built offline, split into *fit* and *score*.

Sources (all generated here or shipped by installed packages; nothing is downloaded):

| category | fit split | score split |
|---|---|---|
| english | METADATA of installed Python packages named a-l | METADATA of packages named m-z |
| code | Python stdlib modules named a-l | stdlib modules named m-z |
| json | JSON files of installed Python packages under names a-l | the same under m-z |
| shell | dpkg's, apt's terminal and the alternatives logs; `ls -l`-style listings of system folders | apt's history log; `ls -l`-style listings of stdlib and site-packages folders |
| cyrillic_cjk | gettext catalogues (ru, uk, ja, zh_CN, ko) of domains a-l | domains m-z |
| mixed | turns drawn from the fit texts of every category | from the score texts |

Catalogues the size weights of ``core/sizing.py`` were read off (gnupg, systemd) and the vim
tutors are left out of both splits. The split is by source name, so no file is in both.
"""

from __future__ import annotations

import gettext
import glob
import json
import os
import random
import stat
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from contextsvc.core.messages import Message, Role, ToolCall

CATEGORIES = ("english", "code", "json", "shell", "cyrillic_cjk", "mixed")
_SITE = sysconfig.get_paths()["purelib"]
_STDLIB = sysconfig.get_paths()["stdlib"]
_LOCALES = ("ru", "uk", "ja", "zh_CN", "ko")
_EXCLUDED_DOMAINS = ("gnupg", "systemd", "vim")


def _fit_name(name: str) -> bool:
    return name[:1].lower() < "m"


def _chunks(text: str, rng: random.Random, lo: int = 300, hi: int = 2400) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(lo, hi)
        piece = text[i : i + n].strip()
        if len(piece) >= lo // 2:
            out.append(piece)
        i += n
    return out


def _read(path: str, limit: int = 60_000) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="strict")[:limit]
    except (OSError, UnicodeDecodeError):
        return ""


def _english(split: str) -> list[str]:
    files = sorted(glob.glob(f"{_SITE}/*.dist-info/METADATA"))
    return [_read(f, 12_000) for f in files if _fit_name(Path(f).parent.name) == (split == "fit")]


def _code(split: str) -> list[str]:
    files = sorted(glob.glob(f"{_STDLIB}/*.py"))
    return [_read(f, 20_000) for f in files if _fit_name(Path(f).name) == (split == "fit")]


def _json(split: str) -> list[str]:
    files = sorted(glob.glob(f"{_SITE}/**/*.json", recursive=True))
    out = []
    for f in files:
        rel = os.path.relpath(f, _SITE)
        if _fit_name(rel) != (split == "fit") or os.path.getsize(f) < 2000:
            continue
        text = _read(f, 20_000)
        if text.lstrip()[:1] in "{[":
            out.append(text)
    return out[:120]


def _listing(folder: str) -> str:
    lines = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name)[:200]:
        st = entry.stat(follow_symlinks=False)
        mtime = time.strftime("%b %d %H:%M", time.gmtime(st.st_mtime))
        lines.append(f"{stat.filemode(st.st_mode)} 1 root root {st.st_size:>9} {mtime} {entry.name}")
    return "\n".join(lines)


def _shell(split: str) -> list[str]:
    if split == "fit":
        listings = [_listing(d) for d in ("/usr/bin", "/etc", "/usr/lib/x86_64-linux-gnu", "/usr/share/doc")]
        logs = [_read(f, 200_000) for f in ("/var/log/dpkg.log", "/var/log/apt/term.log", "/var/log/alternatives.log")]
        return [*logs, *(text for text in listings if text)]
    listings = [_listing(d) for d in (_STDLIB, f"{_STDLIB}/asyncio", f"{_STDLIB}/email", _SITE) if os.path.isdir(d)]
    return [_read("/var/log/apt/history.log", 200_000), *listings]


def catalog_strings(locale: str, wanted: Callable[[str], bool]) -> Iterator[list[str]]:
    """The translated strings of each message catalogue of ``locale`` installed on the machine
    whose domain name ``wanted`` accepts, one list per catalogue, in name order."""
    for f in sorted(glob.glob(f"/usr/share/locale/{locale}/LC_MESSAGES/*.mo")):
        if not wanted(Path(f).stem):
            continue
        try:
            with open(f, "rb") as fh:
                catalog = gettext.GNUTranslations(fh)._catalog  # type: ignore[attr-defined]
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        yield [v for v in catalog.values() if isinstance(v, str)]


def _catalogues(split: str) -> list[str]:
    def wanted(name: str) -> bool:
        return not name.startswith(_EXCLUDED_DOMAINS) and _fit_name(name) == (split == "fit")

    out = []
    for loc in _LOCALES:
        for strings in catalog_strings(loc, wanted):
            values = [v for v in strings if v and not v.isascii()]
            if values:
                out.append("\n".join(values)[:15_000])
    return out


SOURCES = {"english": _english, "code": _code, "json": _json, "shell": _shell, "cyrillic_cjk": _catalogues}


def texts(category: str, split: str, seed: int) -> list[str]:
    rng = random.Random(f"{seed}:{category}:{split}")
    out = []
    for text in SOURCES[category](split):
        out += _chunks(text, rng)
    rng.shuffle(out)
    return out


_ASKS = (
    "Can you look at this and tell me what matters?",
    "Please check the output below and summarize the problem.",
    "What does this file do? Keep it short.",
    "Run the next step and report back.",
    "Посмотри, пожалуйста, и скажи, что не так.",
    "请检查一下这个输出，告诉我问题在哪里。",
)
_TOOLS = ("read_file", "run_command", "search_code", "http_get")


@dataclass
class Session:
    category: str
    system: str
    steps: list[list[Message]] = field(default_factory=list)


_SYSTEM = (
    "You are a careful engineering agent. Use the tools to read files and run commands; cite paths "
    "and line numbers; say plainly when something failed."
)


def sessions(split: str, *, count: int, steps: int, seed: int = 20261201) -> dict[str, list[Session]]:
    pools = {c: texts(c, split, seed) for c in SOURCES}
    rng = random.Random(f"{seed}:{split}:sessions")
    out: dict[str, list[Session]] = {}
    for category in CATEGORIES:
        made = []
        for s in range(count):
            sess = Session(category, _SYSTEM)
            for k in range(steps):
                src = rng.choice(tuple(SOURCES)) if category == "mixed" else category
                pool = pools[src]
                body = pool[(s * steps + k) % len(pool)]
                ask = rng.choice(_ASKS[3:] if src == "cyrillic_cjk" and rng.random() < 0.6 else _ASKS[:4])
                call_id = f"call_{seed % 1000}_{s}_{k}"
                tool = rng.choice(_TOOLS)
                args = json.dumps({"path": f"src/module_{k}.py", "limit": rng.randint(10, 500)})
                step = [
                    Message(role=Role.USER, content=ask),
                    Message(role=Role.ASSISTANT, content="", tool_calls=(ToolCall(call_id, tool, args),)),
                    Message(role=Role.TOOL, content=body, tool_call_id=call_id, name=tool),
                    Message(role=Role.ASSISTANT, content=body[: rng.randint(80, 400)]),
                ]
                sess.steps.append(step)
            made.append(sess)
        out[category] = made
    return out
