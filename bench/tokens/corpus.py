# ruff: noqa: RUF001, SIM905  (Cyrillic word lists, kept readable as one string each)
"""A deterministic corpus of agent sessions: English prose, Python code, JSON tool output,
Cyrillic text and mixed agent turns. Generated from a seed; nothing is downloaded.

A session is a system prompt and a list of steps; a step is the messages appended before the
next model call (so the view of call k is the system prompt plus steps 0..k).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from contextsvc.core.messages import Message, Role, ToolCall

KINDS = ("english", "code", "json", "cyrillic", "mixed")

_EN = (
    "the of and to in is that it for was on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most know "
    "get through back much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every found still between name should "
    "home big give air line set own under read last never us left end along while might next sound below saw "
    "something thought both few those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life enough took sometimes "
    "four head above kind began almost live page got earth need far hand high year mother light parts country "
    "father let night following picture being study second eyes soon times story boys since white days ever paper "
    "hard near sentence better best across during today others however sure means knew itself together "
    "deployment configuration repository migration dependency performance requirement investigation authentication "
    "throughput latency database service customer quarterly revenue transaction invoice schedule meeting release "
    "document analysis architecture interface compatibility regression incident monitoring threshold"
).split()

_RU = (
    "и в не на я что тот быть с он а весь это как она по но они к у ты из мы за вы так же от сказать этот который "
    "мочь человек о один еще бы такой только себя свой какой когда уже для вот кто да говорить год знать мой до или "
    "если время рука нет самый ни стать большой даже другой наш свой ну под где дело есть сам раз чтобы два там чем "
    "глаз жизнь первый день тут во ничто потом очень со хотеть ли при голова надо без видеть идти теперь тоже стоять "
    "друг дом сейчас можно после слово здесь думать место спросить через лицо что тогда ведь хороший каждый новый "
    "жить должный смотреть почему потому сторона просто нога сидеть понять иметь конечный делать вдруг над взять "
    "никто сделать дверь перед нужный понимать казаться работа три ваш уж земля конец несколько час голос город "
    "последний пока хорошо давать вода более хотя всегда второй куда пойти стол ребенок увидеть сила отец женщина "
    "машина случай ночь сразу мир совсем остаться об вид выйти дать работать любить старый почти ряд оказаться "
    "начало твой вопрос много война снова ответить между подумать опять белый деньги значит про лишь минута жена "
    "посмотреть правда главный страна свет ждать мать будто никогда товарищ дорога однако лежать именно окно никакой "
    "найти писать комната москва часть вообще книга маленький улица решить далекий душа чуть вернуться утро "
    "развертывание конфигурация репозиторий миграция зависимость производительность требование сервер клиент "
    "отчет квартал выручка транзакция расписание совещание выпуск документ анализ архитектура интерфейс"
).split()

_IDENT = (
    "user session token cache config path item items value result data request response client server buffer "
    "context window message index count total limit offset page size name key store record event batch queue "
    "worker task job state status error retry timeout handler parser builder loader writer reader stream chunk"
).split()

_TYPES = ("int", "str", "float", "bool", "bytes", "list[str]", "dict[str, Any]", "Path", "Message", "None")

_SYSTEM = (
    "You are a careful software engineering agent working in a repository on the user's machine. Use the tools to "
    "read files, run commands and edit code; never guess a file's content. Keep answers short, cite paths and line "
    "numbers, and say plainly when something failed. Before a destructive command, ask. When a task is done, "
    "summarize what changed and how it was verified. Follow the project's style guide and run its tests and "
    "linters before you report success."
)


def english(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        words = [rng.choice(_EN) for _ in range(rng.randint(6, 24))]
        if rng.random() < 0.3:
            words.insert(rng.randint(1, len(words) - 1), f"{rng.randint(2, 9999)}")
        if rng.random() < 0.25:
            words[rng.randint(1, len(words) - 1)] += ","
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".....?!")
        out.append(sentence)
        size += len(sentence) + 1
        if rng.random() < 0.15:
            out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n")[:chars]


def cyrillic(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        words = [rng.choice(_RU) for _ in range(rng.randint(5, 20))]
        if rng.random() < 0.2:
            words.insert(rng.randint(1, len(words) - 1), f"{rng.randint(2, 9999)}")
        if rng.random() < 0.3:
            words[rng.randint(1, len(words) - 1)] += ","
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice("....?!")
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)[:chars]


def _ident(rng: random.Random, parts: int = 2) -> str:
    return "_".join(rng.choice(_IDENT) for _ in range(parts))


def python_code(rng: random.Random, chars: int) -> str:
    lines = [
        "from __future__ import annotations",
        "",
        "import json",
        "from pathlib import Path",
        "from typing import Any",
    ]
    while sum(len(x) + 1 for x in lines) < chars:
        lines.append("")
        lines.append("")
        if rng.random() < 0.3:
            cls = "".join(w.capitalize() for w in _ident(rng).split("_"))
            lines.append(f"class {cls}:")
            lines.append(f'    """{english(rng, rng.randint(30, 90)).strip()}"""')
            indent = "    "
            lines.append("")
        else:
            indent = ""
        for _ in range(rng.randint(1, 3)):
            args = ", ".join(f"{_ident(rng, 1)}_{i}: {rng.choice(_TYPES)}" for i in range(rng.randint(1, 4)))
            if indent:
                args = "self, " + args
            lines.append(f"{indent}def {_ident(rng)}({args}) -> {rng.choice(_TYPES)}:")
            lines.append(f'{indent}    """{english(rng, rng.randint(20, 80)).strip()}"""')
            for _ in range(rng.randint(2, 8)):
                a, b = _ident(rng), _ident(rng, 1)
                choice = rng.random()
                if choice < 0.25:
                    lines.append(f"{indent}    {a} = {b}.get({json.dumps(_ident(rng, 1))}, {rng.randint(0, 512)})")
                elif choice < 0.45:
                    lines.append(f"{indent}    for {b} in {a}:")
                    lines.append(f"{indent}        if {b} is None or len({b}) > {rng.randint(1, 64)}:")
                    lines.append(f"{indent}            continue")
                elif choice < 0.6:
                    lines.append(f"{indent}    # {english(rng, rng.randint(20, 70)).strip()}")
                elif choice < 0.75:
                    lines.append(f"{indent}    if not {a}:")
                    lines.append(f'{indent}        raise ValueError(f"bad {b}: {{{a}!r}}")')
                else:
                    lines.append(f"{indent}    {a}.append(self._{b}[{rng.randint(0, 9)}] * {rng.random():.3f})")
            lines.append(f"{indent}    return {_ident(rng)}")
            lines.append("")
    return "\n".join(lines)[:chars]


def json_output(rng: random.Random, chars: int) -> str:
    records = []
    size = 0
    while size < chars:
        kind = rng.random()
        if kind < 0.4:
            rec: dict[str, object] = {
                "path": "/".join(["src", *(_ident(rng, 1) for _ in range(rng.randint(1, 3)))]) + ".py",
                "size": rng.randint(10, 90_000),
                "modified": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
                f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z",
                "mode": rng.choice(["0644", "0755"]),
            }
        elif kind < 0.7:
            rec = {
                "id": f"{rng.getrandbits(128):032x}",
                "status": rng.choice(["ok", "failed", "pending", "retrying"]),
                "attempts": rng.randint(0, 5),
                "latency_ms": round(rng.uniform(0.1, 900), 2),
                "tags": [_ident(rng, 1) for _ in range(rng.randint(0, 4))],
            }
        else:
            rec = {
                "line": rng.randint(1, 4000),
                "match": english(rng, rng.randint(20, 90)).strip(),
                "score": round(rng.random(), 4),
                "context": {"before": _ident(rng, 3), "after": _ident(rng, 2)},
            }
        records.append(rec)
        size += len(json.dumps(rec)) + 4
    indent = 2 if rng.random() < 0.5 else None
    return json.dumps({"ok": True, "count": len(records), "results": records}, indent=indent)[:chars]


def _filler(rng: random.Random, kind: str, chars: int) -> str:
    return {"english": english, "code": python_code, "json": json_output, "cyrillic": cyrillic}[kind](rng, chars)


@dataclass
class Session:
    kind: str
    system: str
    steps: list[list[Message]] = field(default_factory=list)


def _pure_session(rng: random.Random, kind: str, steps: int) -> Session:
    """User asks and assistant answers, every content of one kind (the system prompt is English)."""
    s = Session(kind, _SYSTEM)
    for i in range(steps):
        if i % 2 == 0:
            step = [Message(role=Role.USER, content=_filler(rng, kind, rng.randint(300, 3000)))]
        else:
            step = [Message(role=Role.ASSISTANT, content=_filler(rng, kind, rng.randint(800, 7000)))]
        s.steps.append(step)
    return s


def _mixed_session(rng: random.Random, steps: int) -> Session:
    """An agent loop: a user ask, then tool calls and results of every kind, then an answer."""
    s = Session("mixed", _SYSTEM)
    call = 0
    for i in range(steps):
        if i == 0 or rng.random() < 0.15:
            lang = english if rng.random() < 0.6 else cyrillic
            ask = lang(rng, rng.randint(150, 1500))
            if rng.random() < 0.3:
                ask += "\n\n```python\n" + python_code(rng, rng.randint(200, 900)) + "\n```"
            s.steps.append([Message(role=Role.USER, content=ask)])
            continue
        call += 1
        call_id = f"call_{rng.getrandbits(48):012x}"
        tool, result_kind = rng.choice(
            [
                ("read_file", "code"),
                ("search", "json"),
                ("list_dir", "json"),
                ("run", "english"),
                ("fetch_doc", "cyrillic"),
            ]
        )
        args = json.dumps({"path": "src/" + _ident(rng, 2) + ".py", "limit": rng.randint(50, 400)})
        assistant = Message(
            role=Role.ASSISTANT,
            content=english(rng, rng.randint(0, 300)).strip() if rng.random() < 0.5 else "",
            thinking=english(rng, rng.randint(100, 900)).strip() if rng.random() < 0.6 else "",
            tool_calls=(ToolCall(call_id, tool, args),),
        )
        result = Message(
            role=Role.TOOL,
            content=_filler(rng, result_kind, rng.randint(400, 8000)),
            tool_call_id=call_id,
            name=tool,
        )
        s.steps.append([assistant, result])
    return s


def sessions(kind: str, count: int, steps: int, seed: int = 20261129) -> list[Session]:
    """``count`` sessions of ``steps`` model calls each, the same for the same arguments."""
    out = []
    for n in range(count):
        rng = random.Random(f"{seed}:{kind}:{n}")
        out.append(_mixed_session(rng, steps) if kind == "mixed" else _pure_session(rng, kind, steps))
    return out
