"""Breadcrumbs: the findable facts of text that compression removed (DESIGN §2, §5.4, §5.6).

A summary's ``KEYS:`` line names what its model thought mattered; the entities extracted here
(paths, commands, ids, amounts, links, names) cover what it missed, and the hard-truncate
fallback that runs no summarizer at all. Pure and deterministic: the same input gives the same
list, in order of first appearance.

A breadcrumb never holds ``;`` or a line break, so a list of them round-trips through one
``KEYS: a; b; c`` line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from enum import IntEnum

from contextsvc.config import SummarizerSettings
from contextsvc.core.lazy_re import DIGIT, LazyPattern, lazy, may_match
from contextsvc.core.messages import Message

__all__ = [
    "Entity",
    "EntityKind",
    "canonical_key",
    "extract_breadcrumbs",
    "extract_entities",
    "format_keys_line",
    "merge_breadcrumbs",
    "shared_extraction",
    "split_keys_line",
]

# The numbers live in the settings; these defaults only serve callers without settings at hand.
_FIELDS = SummarizerSettings.model_fields
DEFAULT_LIMIT: int = _FIELDS["breadcrumb_limit"].default
DEFAULT_MAX_CHARS: int = _FIELDS["breadcrumb_max_chars"].default
DEFAULT_SCAN_CHARS: int = _FIELDS["breadcrumb_scan_chars"].default


class EntityKind(IntEnum):
    """What an entity is. The value is its rank: when there are more than ``limit`` entities,
    lower ranks are kept first (a path outlives a quoted word)."""

    COMMAND = 0
    PATH = 1
    URL = 2
    EMAIL = 3
    TICKET = 4
    UUID = 5
    HASH = 6
    ADDRESS = 7
    IDENTIFIER = 8
    QUOTED = 9
    VERSION = 10
    AMOUNT = 11
    QUANTITY = 12
    CARRIED = -1  # a breadcrumb of an earlier summary that is now being dropped


@dataclass(slots=True, frozen=True)
class Entity:
    kind: EntityKind
    text: str


# --- patterns -------------------------------------------------------------------------------
# Each is tried over the whole text; overlapping matches are resolved longest-first, so a URL
# is not also reported as the path inside it.

_NOT_AFTER_WORD = r"(?<![\w@/.\-])"
_UNITS = (
    r"ms|µs|us|ns|s|sec|secs|seconds?|min|mins|minutes?|h|hrs?|hours?|days?|weeks?|months?|years?"
    r"|b|bytes?|kb|mb|gb|tb|kib|mib|gib|tib|k|m|bn"
    r"|px|pt|em|dpi|fps|hz|khz|mhz|ghz|rpm|°c|°f|mm|cm|km|kg|g|mg|lb|lbs"
    r"|tokens?|chars?|lines?|rows?|files?|items?|requests?|calls?|users?|turns?|messages?|x"
    r"|usd|eur|gbp|rub|jpy|cny|\u0440\u0443\u0431|₽|€|\$"
)


@functools.cache
def _patterns() -> tuple[tuple[EntityKind, re.Pattern[str], tuple[str | LazyPattern, ...] | None], ...]:
    """The entity patterns, compiled on first use: ~10 ms of compiling that a server start would
    otherwise pay for the first compaction (issue #9, start-up time). Each with what it cannot
    match without (``lazy_re.may_match``: one of these substrings, a digit, or a gate pattern
    found wherever the pattern matches; None: nothing). A gate starts with a literal or a class
    (a fast scan in ``re``): a full stop ends most sentences of prose, but a dotted name needs a
    letter after its dot, a version or an IPv4 address a digit, a file name its extension's
    letter; a camelCase name needs an upper-case letter right after a lower-case one or a digit."""
    return (
        (
            EntityKind.URL,
            re.compile(r"\b(?:https?|ftp|wss?|grpcs?|s3|file)://[^\s<>\"'`|\\{}\[\]()]+", re.I),
            ("://",),
        ),
        (
            EntityKind.EMAIL,
            re.compile(r"(?<![\w.+-])[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
            ("@",),
        ),
        (
            EntityKind.UUID,
            re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I),
            (lazy(r"-[0-9a-f]", re.I),),
        ),
        # Windows paths, absolute / home / dot-relative POSIX paths, relative paths with a file name.
        (EntityKind.PATH, re.compile(r"\b[A-Za-z]:\\(?:[^\\\s:*?\"<>|;]+\\)*[^\\\s:*?\"<>|;,]+"), (":\\",)),
        (
            EntityKind.PATH,
            re.compile(_NOT_AFTER_WORD + r"(?:~|\.{1,2})?/(?:[\w.@+%=-]+/)*[\w.@+%=-]*[\w@+%=-]"),
            ("/",),
        ),
        (
            EntityKind.PATH,
            # ``+`` in the look-behind too: a match never starts inside a run of the first part's
            # characters, and the part takes its run whole (else every ``+`` restarts the scan).
            re.compile(r"(?<![\w@/.+\-])(?:[\w.@+-]++/)+[\w@+-]*\.[A-Za-z][A-Za-z0-9]{0,7}\b"),
            ("/",),
        ),
        (
            EntityKind.PATH,
            re.compile(
                r"(?<![\w/.\-])[\w-]+\.(?:py|pyi|ts|tsx|js|jsx|mjs|json|jsonl|md|rst|txt|toml|ya?ml|ini|cfg|conf|env"
                r"|go|rs|java|kt|c|h|cc|cpp|hpp|cs|rb|php|swift|sh|bash|zsh|ps1|sql|proto|html|css|scss|vue"
                r"|csv|tsv|xml|lock|log|pdf|docx?|xlsx?|pptx?|png|jpe?g|gif|webp|svg|zip|tar|gz|tgz|whl)\b",
            ),
            (lazy(r"\.[a-z]"),),
        ),
        (EntityKind.TICKET, re.compile(r"\b[A-Z][A-Z0-9]{1,9}(?:-\d+)+\b"), (lazy(r"-\d"),)),
        (EntityKind.ADDRESS, re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b"), (lazy(r"\.\d"),)),
        (EntityKind.ADDRESS, re.compile(r"\blocalhost:\d{1,5}\b"), ("localhost:",)),
        (
            EntityKind.VERSION,
            re.compile(r"(?<![\w.])v\d+(?:\.\d+)+(?:[-+][0-9A-Za-z.]+)?\b|\b\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.]+)?\b"),
            (lazy(r"\.\d"),),
        ),
        (EntityKind.HASH, re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,64}\b"), (DIGIT,)),
        # Identifiers: CamelCase / lowerCamel, snake_case, UPPER_SNAKE, dotted.names.of.things.
        (
            EntityKind.IDENTIFIER,
            re.compile(r"\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+\b|\b[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+\b"),
            (lazy(r"[A-Z](?<=[a-z0-9][A-Z])"),),
        ),
        (EntityKind.IDENTIFIER, re.compile(r"\b_*[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+\b"), ("_",)),
        (EntityKind.IDENTIFIER, re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*){2,}\b"), (lazy(r"\.[A-Za-z_]"),)),
        (
            EntityKind.AMOUNT,
            re.compile(r"(?<![\w.])[$€£¥₽]\s?\d[\d,]*(?:\.\d+)?(?:\s?(?:k|m|bn|million|billion))?\b"),
            ("$", "€", "£", "¥", "₽"),
        ),
        # A quantity's number is taken whole and a number without its unit is matched too, as a
        # match ``_from_text`` drops (no ``unit`` group): the scan goes on after the number instead
        # of again from each of its commas ("1,1,1,...", a row of CSV: the unit list was tried at
        # each step back, ~60 s for 20,000 characters). No quantity starts inside a number: from
        # any of its digits the number runs to the same end.
        (EntityKind.QUANTITY, re.compile(r"(?<![\w./])-?\d[\d,]*+(?:\.\d+)?+(?P<unit>\s?%)?"), ("%",)),
        (
            EntityKind.QUANTITY,
            re.compile(r"(?<![\w./])-?\d[\d,]*+(?:\.\d+)?+(?P<unit>\s?(?:" + _UNITS + r")(?![\w/]))?", re.I),
            (DIGIT,),
        ),
    )


@functools.cache
def _quoted() -> re.Pattern[str]:
    """Quoted names (compiled on first use, as ``_patterns``)."""
    return re.compile(
        r"`([^`\n;]{2,80})`"
        # A double-quoted name neither opens onto JSON punctuation (the gap `": 1, "` after a key)
        # nor is a key itself (followed by `:`).
        r"|\"(?!\s*[:,}\]])([^\"\n;]{2,60})\"(?!\s*:)"
        r"|“([^”\n;]{2,60})”"
        r"|«([^»\n;]{2,60})»"
        r"|(?<![\w'])'([^'\n;]{2,60})'(?![\w'])"
    )


#: what a quoted name opens with (``_quoted``)
_QUOTES = ("`", '"', "“", "«", "'")

_SHELL_PROMPT_ONLY = re.compile(r"^[ \t]*\$[ \t]+(\S.*)$", re.M)
#: tool-call argument keys whose value is a shell command / a file path.
_COMMAND_KEYS = frozenset({"command", "cmd", "commands", "script", "shell", "bash", "run"})
_PATH_KEYS = frozenset(
    {"path", "paths", "file", "files", "file_path", "filepath", "filename", "dir", "directory", "cwd", "target"}
)
#: ticket-shaped tokens that are standards, not tickets.
_NOT_TICKETS = frozenset({"UTF", "SHA", "ISO", "MD", "AES", "RSA", "ECMA", "UCS", "X", "TLS", "SSL", "HTTP"})
#: quoted words too common to be names.
_QUOTED_STOP = frozenset({"yes", "no", "ok", "true", "false", "none", "null", "the", "and", "or"})
_SPACES = re.compile(r"\s+")
#: characters a quoted name never starts or ends with (they mark a JSON fragment).
_FRAGMENT_EDGES = frozenset(":,{}[]=")
#: JSON keys that give a number its meaning (identifier-like, not an array index or a sentence).
_JSON_KEY = re.compile(r"[A-Za-z_][\w.-]{1,40}")
#: JSON documents up to this size are parsed whole; larger ones are scanned as text.
_JSON_PARSE_CHARS = 200_000
_TRAILING_PUNCT = ".,:!?'\")]}>"


#: within ``shared_extraction``: (text, max_chars, scan_chars) -> the text's entities.
_SHARED: ContextVar[dict[tuple[str, int, int], tuple[Entity, ...]] | None] = ContextVar(
    "contextsvc_shared_extraction", default=None
)


@contextlib.contextmanager
def shared_extraction() -> Iterator[None]:
    """Within this block (and the tasks it starts), a text's entities are extracted once: one
    compaction reads the same rows three times (the summary's keys, the breadcrumbs of what it
    drops, the history index), and extraction is most of its CPU. What is remembered lives as
    long as the block, so it is bounded by what the block reads; a nested block shares it."""
    if _SHARED.get() is not None:
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _text_entities(text: str, *, max_chars: int, scan_chars: int) -> Iterable[Entity]:
    shared = _SHARED.get()
    if shared is None:
        return _from_text(text, max_chars=max_chars, scan_chars=scan_chars)
    key = (text, max_chars, scan_chars)
    found = shared.get(key)
    if found is None:
        found = shared[key] = tuple(_from_text(text, max_chars=max_chars, scan_chars=scan_chars))
    return found


def extract_entities(
    items: Iterable[Message | str],
    *,
    limit: int = DEFAULT_LIMIT,
    max_chars: int = DEFAULT_MAX_CHARS,
    scan_chars: int = DEFAULT_SCAN_CHARS,
) -> list[Entity]:
    """The entities of ``items`` (messages or plain texts), deduplicated (case-insensitive), in
    order of first appearance, at most ``limit`` (lower ranks kept first), each at most
    ``max_chars`` long."""
    if limit <= 0:
        return []
    seen: set[str] = set()
    found: list[Entity] = []
    for item in items:
        for entity in _from_item(item, max_chars=max_chars, scan_chars=scan_chars):
            key = _dedupe_key(entity.text)
            if key not in seen:
                seen.add(key)
                found.append(entity)
    if len(found) <= limit:
        return found
    # Keep the most valuable kinds, but report them in order of appearance.
    keep = sorted(range(len(found)), key=lambda i: (found[i].kind, i))[:limit]
    return [found[i] for i in sorted(keep)]


def extract_breadcrumbs(
    items: Iterable[Message | str],
    *,
    limit: int = DEFAULT_LIMIT,
    max_chars: int = DEFAULT_MAX_CHARS,
    scan_chars: int = DEFAULT_SCAN_CHARS,
) -> list[str]:
    """The texts of ``extract_entities`` (see there)."""
    return [e.text for e in extract_entities(items, limit=limit, max_chars=max_chars, scan_chars=scan_chars)]


def merge_breadcrumbs(
    keys_from_summary: Iterable[str],
    extracted: Iterable[str],
    limit: int = DEFAULT_LIMIT,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> list[str]:
    """The summary's keys first, then extracted entities it does not already name; deduplicated.

    Extracted entities keep at least half of ``limit`` when there are that many, so a summary
    with a long KEYS line cannot push out the facts the extractor found on its own."""
    if limit <= 0:
        return []
    from_summary = _dedupe(_clean(k, max_chars) for k in keys_from_summary)
    taken = {_dedupe_key(k) for k in from_summary}
    from_text = [e for e in _dedupe(_clean(x, max_chars) for x in extracted) if _dedupe_key(e) not in taken]
    take_text = min(len(from_text), limit // 2)
    take_summary = min(len(from_summary), limit - take_text)
    take_text = min(len(from_text), limit - take_summary)
    return from_summary[:take_summary] + from_text[:take_text]


def split_keys_line(summary: str) -> tuple[str, list[str]]:
    """Split the ``KEYS:`` line off a summary: ``(text without it, its keys)``. The one KEYS
    parser of the project (``core.compression.split_keys`` is this function).

    The rule, pinned by ``tests/unit/test_keys_line.py``:

    1. The KEYS line is the *last* line whose label reads ``KEYS:`` — any case, an optional
       bullet (``-``, ``*``, ``•``, ``>``) and bold/underline markers around the label, an ASCII
       or full-width colon.
    2. A label in upper case (``KEYS:``) counts wherever it is (a model may add a closing sentence
       after it). Any other spelling (``Keys:``, ``keys:``) counts only when it ends the text —
       nothing but blank lines, or its own bullets, after it — so an ordinary bullet that starts
       with "Keys:" is left alone.
    3. Items are separated by ``;``; by ``,`` only when the line has no ``;`` (so ``1,000 USD``
       survives in a ``;`` list). A bare ``KEYS:`` takes the bullet lines right under it.
    4. Each item is canonicalized by ``canonical_key``: whitespace collapsed; list punctuation,
       quotes and code ticks around it and bold/italic asterisk pairs removed; ``_`` and a lone
       ``*`` kept (``__init__``, ``*args``). Empty items and exact duplicates are dropped.
    5. Without a KEYS line the text comes back unchanged, with no keys.

    ``format_keys_line`` writes a line this reads back to the same keys, and every breadcrumb
    the extractor makes is already canonical, so breadcrumbs round-trip through one line."""
    lines = summary.splitlines()
    for at in range(len(lines) - 1, -1, -1):
        match = _KEYS_LINE.match(lines[at])
        if match is None:
            continue
        rest = match.group("rest").strip()
        if rest.endswith(("**", "__")) and match.group("bold"):  # **KEYS: a; b**
            rest = rest[:-2].rstrip()
        following = lines[at + 1 :]
        bullets = [] if rest else _leading_bullets(following)
        final = all(not line.strip() for line in following[len(bullets) :])
        if not final and match.group("word") != "KEYS":
            continue
        raw = (rest.split(";") if ";" in rest else rest.split(",")) if rest else bullets
        used = at + 1 + len(bullets)
        text = "\n".join(lines[:at] + lines[used:]).rstrip()
        keys: dict[str, None] = {}
        for item in raw:
            if key := canonical_key(item):
                keys.setdefault(key, None)
        return text, list(keys)
    return summary, []


def canonical_key(item: str) -> str:
    """One KEYS item in canonical form (rule 4 of ``split_keys_line``); idempotent."""
    text = _SPACES.sub(" ", item).strip()
    while True:
        before = text
        text = text.strip(_LIST_PUNCT)
        if len(text) > 1 and text[-1] == "." and text[-2].isalnum():  # a full stop, not `ruff check .`
            text = text[:-1]
        text = _BOLD_EDGES.sub("", text).strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in _PAIRS and text[0] not in text[1:-1]:
            text = text[1:-1].strip()  # `a`, "a", 'a', *a*
        if text == before:
            return text


def _leading_bullets(lines: Sequence[str]) -> list[str]:
    items: list[str] = []
    for line in lines:
        bullet = _BULLET.match(line)
        if bullet is None:
            break
        items.append(bullet.group("item"))
    return items


# A marker after the colon closes a bold label (``**KEYS:** a``); only then, and only as a whole
# token, so ``KEYS: __`` and ``**KEYS**: __init__`` keep their keys. Each run of spaces is taken
# whole (``\s*+``): three optional runs in a row split a long blank line every way (cubic).
_KEYS_LINE = re.compile(
    r"^\s*+(?:[-*•>]+\s*+)?#*\s*+(?P<bold>\*\*|__)?\s*+(?P<word>keys)\s*+(?:\*\*|__)?\s*+[:\uff1a]\s*+(?(bold)(?:(?:\*\*|__)(?=\s|$))?)\s*+"
    r"(?P<rest>.*)$",
    re.IGNORECASE,
)
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+(?P<item>.*)$")
# List punctuation around a key goes, and one pair of quotes / code ticks / emphasis around the
# whole key; `_`, a leading `.` and a lone `*` stay: they are part of names (`__init__`, `.env`,
# `*args`), and so does a quote that is part of a command (`echo "hi"`).
_LIST_PUNCT = " \t;,"
_PAIRS = "\"'`*"
#: (The trailing run starts where a run of ``*`` starts: else a long run was tried from each star.)
_BOLD_EDGES = re.compile(r"^\*{2,}|(?<!\*)\*{2,}$")


def format_keys_line(keys: Sequence[str]) -> str:
    """``KEYS: a; b; c`` (``;`` inside a key becomes ``,`` so the line splits back the same)."""
    cleaned = [c for k in keys if (c := _SPACES.sub(" ", k.replace(";", ",")).strip())]
    line = " ".join(["KEYS:", "; ".join(cleaned)]).rstrip()
    # A lone key with a comma would split on ',' when read back; a trailing ';' says "split on ';'".
    return line + ";" if len(cleaned) == 1 and "," in cleaned[0] else line


# --- internals ------------------------------------------------------------------------------


def _from_item(item: Message | str, *, max_chars: int, scan_chars: int) -> Iterator[Entity]:
    if isinstance(item, str):
        yield from _text_entities(item, max_chars=max_chars, scan_chars=scan_chars)
        return
    carried = item.metadata.get("breadcrumbs")
    if isinstance(carried, list):
        for crumb in carried:
            if isinstance(crumb, str) and (text := _clean(crumb, max_chars)):
                yield Entity(EntityKind.CARRIED, text)
    yield from _text_entities(item.content, max_chars=max_chars, scan_chars=scan_chars)
    for call in item.tool_calls:
        yield from _from_arguments(call.arguments_json, max_chars=max_chars, scan_chars=scan_chars)


def _from_arguments(arguments_json: str, *, max_chars: int, scan_chars: int) -> Iterator[Entity]:
    """Commands and paths named by argument keys, then entities of every other string value."""
    try:
        args = json.loads(arguments_json) if arguments_json.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        yield from _from_text(arguments_json, max_chars=max_chars, scan_chars=scan_chars)
        return
    for key, value in _walk(args, depth=0):
        lowered = key.lower()
        if lowered in _COMMAND_KEYS:
            for command in _split_commands(value):
                if text := _clean(command, max_chars):
                    yield Entity(EntityKind.COMMAND, text)
        elif lowered in _PATH_KEYS and value.strip() and not any(c.isspace() for c in value.strip()):
            if text := _clean(value, max_chars):
                yield Entity(EntityKind.PATH, text)
        else:
            yield from _from_text(value, max_chars=max_chars, scan_chars=scan_chars)


def _from_json(document: object, *, max_chars: int, scan_chars: int) -> Iterator[Entity]:
    """Entities of a parsed JSON document: commands and paths by key, short string values as
    names, numbers with the key that gives them their meaning (``total_tokens=79924``), and the
    entities of longer strings. Bounded like ``_walk``."""
    budget = scan_chars
    for key, value in _walk_json(document, depth=0):
        if budget <= 0:
            return
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            if _JSON_KEY.fullmatch(key) and (text := _clean(f"{key}={value}", max_chars)):
                budget -= len(text)
                yield Entity(EntityKind.QUANTITY, text)
            continue
        if not isinstance(value, str):
            continue
        budget -= len(value)
        lowered = key.lower()
        if lowered in _COMMAND_KEYS:
            for command in _split_commands(value):
                if text := _clean(command, max_chars):
                    yield Entity(EntityKind.COMMAND, text)
        elif lowered in _PATH_KEYS and value.strip() and not any(c.isspace() for c in value.strip()):
            if text := _clean(value, max_chars):
                yield Entity(EntityKind.PATH, text)
        else:
            inner = list(_from_text(value, max_chars=max_chars, scan_chars=scan_chars))
            if inner:
                yield from inner
            elif _accept(EntityKind.QUOTED, value.strip()) and (text := _clean(value, max_chars)):
                yield Entity(EntityKind.QUOTED, text)  # a short string value: a name


def _walk_json(value: object, *, depth: int, key: str = "") -> Iterator[tuple[str, object]]:
    """(key, leaf) pairs of a parsed JSON value, leaves being strings, numbers, booleans or null."""
    if depth > 8:
        return
    if isinstance(value, dict):
        for k, v in list(value.items())[:200]:
            yield from _walk_json(v, depth=depth + 1, key=str(k))
    elif isinstance(value, list):
        for v in value[:100]:
            yield from _walk_json(v, depth=depth + 1, key=key)
    else:
        yield key, value


def _walk(value: object, *, depth: int, key: str = "") -> Iterator[tuple[str, str]]:
    """(key, string value) pairs of a parsed JSON value; bounded depth."""
    if depth > 8:
        return
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, depth=depth + 1, key=str(k))
    elif isinstance(value, list):
        for v in value[:100]:
            yield from _walk(v, depth=depth + 1, key=key)


def _from_text(text: str, *, max_chars: int, scan_chars: int) -> Iterator[Entity]:
    stripped = text.strip()
    if stripped[:1] in ("{", "[") and len(stripped) <= _JSON_PARSE_CHARS:
        # A JSON document (a tool's output) is read as JSON: its quotes pair up by the grammar,
        # so no ": 79924"-style fragment between two strings can pass for a quoted name.
        try:
            document = json.loads(stripped)
        except (json.JSONDecodeError, RecursionError):
            document = None
        if isinstance(document, dict | list):
            yield from _from_json(document, max_chars=max_chars, scan_chars=scan_chars)
            return
    text = _scan_window(text, scan_chars)
    if not text:
        return
    spans: list[tuple[int, int, EntityKind, str]] = []
    for match in _SHELL_PROMPT_ONLY.finditer(text) if "$" in text else ():
        for command in _split_commands(match.group(1)):
            spans.append((match.start(1), match.end(1), EntityKind.COMMAND, command))
    for kind, pattern, needs in _patterns():
        if not may_match(text, needs):
            continue
        for match in pattern.finditer(text):
            if "unit" in pattern.groupindex and match.group("unit") is None:
                continue  # a number without its unit (see the quantity patterns)
            value = match.group(0)
            if kind is EntityKind.URL or kind is EntityKind.PATH:
                value = value.rstrip(_TRAILING_PUNCT)
            if _accept(kind, value):
                spans.append((match.start(), match.start() + len(value), kind, value))
    for match in _quoted().finditer(text) if may_match(text, _QUOTES) else ():
        index = next(i for i in range(1, 6) if match.group(i) is not None)
        value = match.group(index).strip()
        if _accept(EntityKind.QUOTED, value):
            spans.append((match.start(index), match.end(index), EntityKind.QUOTED, value))
    # Longest first wins a region; equal spans keep the earlier (higher-priority) pattern.
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    chosen: list[tuple[int, int, EntityKind, str]] = []
    covered_until = -1
    for span in spans:
        start, end, _, _ = span
        if start >= covered_until:
            chosen.append(span)
            covered_until = end
        elif chosen and start == chosen[-1][0] and span[2] is EntityKind.COMMAND:
            chosen.append(span)  # a `$ a; b` line yields several commands over one span
    for _, _, kind, value in chosen:
        if cleaned := _clean(value, max_chars):
            yield Entity(kind, cleaned)


def _accept(kind: EntityKind, value: str) -> bool:
    if kind is EntityKind.TICKET:
        return value.split("-", 1)[0] not in _NOT_TICKETS
    if kind is EntityKind.PATH:
        # Needs a letter and more than a bare slash ("/", "1/2", "and/or" do not qualify).
        return any(c.isalpha() for c in value) and len(value.strip("/~.")) > 1 and "//" not in value
    if kind is EntityKind.QUOTED:
        words = value.split()
        return (
            0 < len(words) <= 6
            and any(c.isalpha() for c in value)
            # Whole names only: a span that starts or ends in JSON punctuation is the gap
            # between two strings (`": 79924, "`), not a quoted name.
            and value[0] not in _FRAGMENT_EDGES
            and value[-1] not in _FRAGMENT_EDGES
            and '"' not in value  # single-quoted or ticked across JSON strings
            and value.lower() not in _QUOTED_STOP
            and not value.endswith((".", "!", "?"))
        )
    if kind is EntityKind.IDENTIFIER:
        return len(value) >= 3
    return True


def _split_commands(value: str) -> list[str]:
    # Separate commands on ';' so no breadcrumb holds the KEYS separator; '&&' pipelines stay whole.
    return [part.strip() for part in value.replace("\r", "").replace("\n", ";").split(";") if part.strip()]


def _scan_window(text: str, scan_chars: int) -> str:
    if len(text) <= scan_chars:
        return text
    head = scan_chars * 3 // 4
    return text[:head] + "\n" + text[len(text) - (scan_chars - head) :]


def _clean(value: str, max_chars: int) -> str:
    """A breadcrumb in the canonical KEYS form (``canonical_key``), so it reads back unchanged."""
    text = canonical_key(value.replace(";", ","))
    if len(text) > max_chars:
        text = canonical_key(text[: max(1, max_chars - 1)]) + "…"
    return text if text != "…" else ""


def _dedupe_key(text: str) -> str:
    return text.casefold().rstrip("/")


def _dedupe(values: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for value in values:
        key = _dedupe_key(value)
        if value and key not in seen:
            seen.add(key)
            out.append(value)
    return out
