"""Fact lines: the concrete details a summary must carry forward (DESIGN §5.5).

A summary that keeps "what was discussed" but drops the hostname, the file and line, the id, the
person's name or the user's standing preference is what made a 400-turn session forget all 20
planted facts. So before any summary is written, the dropped rows are scanned for sentences (and
tool-output lines) that hold such *anchors* — identifiers, numbers with units, paths, hostnames,
URLs, names, dates, error lines — or that state a preference or decision ("prefer", "always",
"never", "must", "don't"). They become deduplicated one-line facts, ranked by how many anchors
they hold, how often those anchors are referenced elsewhere, and recency, within a budget.
A later line that revises an earlier fact ("Correction: the deploy target is now sigma-2") takes
that fact's place: the earlier one is dropped, so a summary never carries the stale value alone.

The extractive summarizer writes them under a ``Facts:`` header; a later fold reads that section
back (``carried_facts``) so facts survive any number of compactions without nesting summaries;
LLM summarizers get the same lines in their input (``facts_block``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contextsvc.core.lazy_re import DIGIT, FoldedPattern, LazyPattern, folded, lazy, may_match
from contextsvc.core.messages import Message, Role

__all__ = ["FACTS_HEADER", "anchor_kinds", "carried_facts", "fact_lines", "facts_block", "strip_facts"]

FACTS_HEADER = "Facts:"

#: Letters a name is written in: Latin (with accents) and Cyrillic, as escapes.
_UPPER = r"A-Z\u00c0-\u00d6\u00d8-\u00de\u0410-\u042f\u0401"
_LOWER = r"a-z\u00df-\u00f6\u00f8-\u00ff\u0430-\u044f\u0451"


def _run_start(run: str, separators: str) -> str:
    """The start of a pattern whose value (group ``v``) is a run of ``[run]`` characters from its
    first word character: the run's head, then its leading ``separators`` taken whole. A search
    otherwise tries again from every character inside a long run (``a.a.a.…``: quadratic,
    seconds for one 20,000-character sentence); from any of them the run ends at the same place."""
    return rf"(?<![{run}])[{separators}]*+"


def _value(match: re.Match[str]) -> str:
    """A match's value: its ``v`` group when the pattern has one and it took part, else all of it."""
    return (match.group("v") if "v" in match.re.groupindex else None) or match.group(0)


# ``host`` and ``id`` start where their run starts for the same reason (``(?<![a-z0-9_][.-])``);
# their first label or word may hold underscores (``_dmarc.mail.example.com``, ``my_app-worker-3``),
# so the run's head matches and nothing inside it needs another try.
_ANCHORS: dict[str, LazyPattern | FoldedPattern] = {
    "url": lazy(r"\bhttps?://[^\s<>\"')\]]+"),
    "path": lazy(
        r"(?:~|\.{1,2})?/(?:[\w.@+-]+/)*[\w.@+-]+|"
        + _run_start(r"\w.-", ".-")
        + r"(?P<v>\w[\w.-]*/[\w./-]*\w\.\w{1,5}\b)"
    ),
    "file_line": lazy(_run_start(r"\w./-", "./-") + r"(?P<v>\w[\w./-]*\.\w{1,5}:\d+\b)"),
    "host": folded(
        r"\b(?<![a-z0-9_][.-])(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.){2,}[a-z]{2,}\b|\b(?:\d{1,3}\.){3}\d{1,3}\b"
    ),
    "email": lazy(_run_start(r"\w.+-", ".+-") + r"(?P<v>\w[\w.+-]*@[\w-]+\.[\w.-]+\b)"),
    "date": folded(
        r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
        r" \d{1,2}(?:st|nd|rd|th)?(?:,? \d{4})?\b"
    ),
    "quantity": folded(
        r"\b\d+(?:[.,]\d+)?\s?(?:ms|s|sec|seconds?|minutes?|min|h|hours?|days?|kb|mb|gb|tb|kib|mib|gib|%|px|tokens?"
        r"|cores?|rps|qps|usd|eur|\$)\b"
    ),
    "id": lazy(
        r"\b[A-Z][A-Z0-9]{1,9}-\d{2,}\b|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"
        r"|\b[0-9a-f]{7,40}\b(?=[^\w]|$)|\b(?<![a-z0-9_]-)[a-z][a-z0-9_]*(?:-[a-z0-9]+)*-\d+[a-z]?\b|\b[a-z]+_[a-z0-9_]+\b|\b[a-z]+[A-Z]\w+\b"
    ),
    "name": lazy(rf"(?<=[{_LOWER},;:] )(?:[{_UPPER}][{_LOWER}]+(?: [{_UPPER}][{_LOWER}]+)*)"),
}
#: An error word: the sentence is an error line (in a tool's output), whichever word it is.
_ERROR = folded(r"\b(?:error|exception|traceback|failed|fatal|denied|refused|timed out)\b")
#: What each anchor cannot match without (``lazy_re.may_match``); a kind not named needs nothing.
#: An id is one of: a key or a UUID or a word numbered with ``-`` (``ABC-12``, ``worker-3``), a
#: snake_case word, a camelCase word (a lower-case letter right before an upper-case one), or a
#: run of 7 or more hex digits. Its scan tries several of them at every word (~20 µs a sentence of
#: prose); the gates find the last two. A gate that starts with a literal (or a class, then a
#: look-behind) is a fast scan in ``re``: a host needs a dot before a label's character (a
#: sentence's full stop alone is no host), a file line a colon before its digits, a name an upper-
#: case letter after a lower-case one or punctuation and a space (where ``name`` starts), a
#: camelCase id an upper-case letter right after a lower-case one.
_NEEDS: dict[str, tuple[str | LazyPattern, ...]] = {
    "url": ("://",),
    "path": ("/",),
    "file_line": (lazy(r":\d"),),
    "host": (lazy(r"\.\w"),),
    "email": ("@",),
    "date": (DIGIT,),
    "quantity": (DIGIT,),
    "id": ("-", "_", lazy(r"[A-Z](?<=[a-z][A-Z])"), lazy(r"[0-9a-f]{7}")),
    "name": (lazy(rf"[{_UPPER}](?<=[{_LOWER},;:] [{_UPPER}])"),),
}
_PREFERENCE = folded(
    r"\b(?:prefer|preferred|always|never|must|don't|do not|dont|should(?:n't)?|remember|from now on|make sure"
    r"|decided|decision|we will|agreed|my name is|call me)\b"
)
#: A sentence that says it revises something said before (a correction, a reversal, a change).
#: Bare "update", "change" or "replace" are not cues: "I updated app.yaml to add logging" revises
#: nothing said of app.yaml before; "changed to", "updated to", "replaced with" are. Nor is
#: "forget" alone ("don't forget to back up db-3" is a reminder).
_REVISION = folded(
    r"\b(?:correction|corrected|switch(?:ed)?|(?:changed?|updated?|moved) to|change of plan|changed my mind"
    r"|replaced? (?:with|by)|no longer|revers(?:e|ed|ing)|reverted|scratch that|no wait"
    r"|(?<!don't )(?<!do not )forget (?:that|it|about))\b"
)
#: Cues that revise only in the user's mouth: an assistant's "actually", "instead" or "is now" is
#: mostly about its own work ("the test actually fails because...", "app.yaml is now formatted"),
#: not a correction of a stated fact.
_USER_REVISION = folded(
    r"\b(?:actually|instead|rather than|any ?more|from now on|(?:is|are|was|were) now"
    r"|now (?:is|are|uses?|runs?|points?|lives?))\b|^no\b"
)
#: Words of a fact that tell what it is about (``_topic``): 3+ letters, not the commonest ones.
_WORD = lazy(r"[^\W\d_][\w-]{2,}")
_COMMON_WORDS = (
    "the and for are was were with this that from our your you its has have had not but all any can "
    "will would should could into onto than then them they their there here now use using used please "
    "also just only some more most very been being does did done get got one two "
    # the revision cues themselves: two corrections of different things share them
    "correction corrected actually instead change changed plan switch switched moved longer anymore "
    "update updated updates updating reverse reversed reversing reverted scratch forget replace replaced "
    "rather remember note"
)
_STOPWORDS = frozenset(_COMMON_WORDS.split())
#: Topic words (an anchor counts as one word) a revision must share with the fact it replaces:
#: with 2, "From now on, the api service logs go to..." replaced "Always deploy the api service
#: to sigma-2 first" for "api service" alone.
_REVISION_OVERLAP = 3
_SENTENCE = lazy(r"(?<=[.!?])\s+|\n+")
#: What ``_SENTENCE`` splits at needs (its look-behind's scan at every character is ~6 µs a line).
_SENTENCE_ENDS = (".", "!", "?", "\n")
_SPACES = lazy(r"\s+")
_COMMON_NAMES = frozenset({"I", "The", "This", "That", "It", "We", "You", "OK", "Yes", "No"})


@dataclass(slots=True)
class _Candidate:
    text: str
    anchors: frozenset[str]
    preference: bool
    recency: int
    from_user: bool
    carried: bool = False
    #: the fact says it revises an earlier one (``_REVISION``), and what it is about (``_topic``,
    #: filled in by ``_supersede`` when there is a revision)
    revision: bool = False
    topic: frozenset[str] = frozenset()


def _anchors(sentence: str, *, errors: bool = True) -> set[str]:
    """The anchors ``sentence`` holds; with ``errors``, an ``error:`` one when it has an error word."""
    found: set[str] = set()
    for kind, pattern in _ANCHORS.items():
        if not may_match(sentence, _NEEDS.get(kind)):
            continue
        for match in pattern.finditer(sentence):
            value = _value(match).strip(".,;:")
            if kind == "name" and value in _COMMON_NAMES:
                continue
            if len(value) >= 3:
                found.add(value.casefold())
    if errors and _ERROR.search(sentence):
        found.add("error:" + sentence[:60].casefold())
    return found


_IPV4 = lazy(r"\b(?:\d{1,3}\.){3}\d{1,3}\b")


def anchor_kinds(text: str) -> set[str]:
    """Which kinds of anchors ``text`` holds: ``url``, ``path``, ``file_line``, ``host``, ``ip``,
    ``email``, ``date``, ``quantity``, ``id``, ``name`` (error words are left to the text itself).
    Search adds a word per kind to a chunk's terms, so "which IP address" finds a line with one."""
    found: set[str] = set()
    for kind, pattern in _ANCHORS.items():
        if not may_match(text, _NEEDS.get(kind)):
            continue
        # One anchor is enough to name its kind: the rest of the text's anchors of it are not
        # read (a chunk holds dozens of names). ``host`` yields two kinds, so it reads on until both.
        wanted = 2 if kind == "host" else 1
        before = len(found)
        for match in pattern.finditer(text):
            value = _value(match).strip(".,;:")
            if len(value) < 3 or (kind == "name" and value in _COMMON_NAMES):
                continue
            found.add("ip" if kind == "host" and _IPV4.fullmatch(value) else kind)
            if len(found) - before == wanted:
                break
    return found


def _sentences(m: Message) -> list[str]:
    text = m.content[:50_000]
    if m.role is Role.TOOL:
        return [line.strip() for line in text.splitlines() if line.strip()]
    if not may_match(text, _SENTENCE_ENDS):
        return [text.strip()] if text.strip() else []  # what the split gives: nothing to split at
    return [s.strip() for s in _SENTENCE.split(text) if s.strip()]


def _clip(text: str, limit: int) -> str:
    flat = _SPACES.sub(" ", text).strip().lstrip("-•* ").strip()
    return flat if len(flat) <= limit else flat[: max(1, limit - 1)].rstrip() + "…"


def carried_facts(summary_text: str) -> list[str]:
    """The fact lines of an earlier summary's ``Facts:`` section (without their ``- ``)."""
    out: list[str] = []
    inside = False
    for line in summary_text.splitlines():
        if line.strip() == FACTS_HEADER:
            inside = True
            continue
        if inside:
            if line.startswith("- "):
                out.append(line[2:].strip())
            else:
                inside = False
    return out


def strip_facts(summary_text: str) -> str:
    """``summary_text`` without its ``Facts:`` section."""
    out: list[str] = []
    inside = False
    for line in summary_text.splitlines():
        if line.strip() == FACTS_HEADER:
            inside = True
            continue
        if inside and line.startswith("- "):
            continue
        inside = False
        out.append(line)
    return "\n".join(out)


def _topic(sentence: str, anchors: frozenset[str]) -> frozenset[str]:
    """What a fact is about: its anchors, each once, and its other words that are not the
    commonest ones (the words inside an anchor are not counted again: one shared path must not
    pass for a shared subject)."""
    text = sentence.casefold()
    for anchor in sorted(anchors, key=len, reverse=True):
        text = text.replace(anchor.casefold(), " ")
    words = {w for w in (m.group(0) for m in _WORD.finditer(text)) if w not in _STOPWORDS}
    return frozenset(words | {a.casefold() for a in anchors})


def _supersede(candidates: list[_Candidate]) -> list[_Candidate]:
    """``candidates`` (oldest first) without the facts a later one revises.

    A revision (``_REVISION``: "correction", "actually", "is now", "switched to"...) replaces every
    earlier fact it shares ``_REVISION_OVERLAP`` topic words with (an anchor counts: "forget kappa-7"
    names the old value): the summary must not go on stating the old value as a fact, and ranked
    below the facts carried from earlier summaries a newer line never got in. So the revision also
    takes the rank the replaced fact had (carried, a preference), and is carried on from then on.
    """
    if not any(c.revision for c in candidates):
        return candidates
    for c in candidates:  # (only now: most compactions hold no revision)
        c.topic = _topic(c.text, c.anchors)
    # The earlier candidates by topic word: a revision counts shared words only among those that
    # share one (a compaction of a few hundred rows holds thousands of candidates).
    by_word: dict[str, list[int]] = {}
    dropped: set[int] = set()
    for k, c in enumerate(candidates):
        if c.revision:
            shared: Counter[int] = Counter()
            for word in c.topic:
                shared.update(by_word.get(word, ()))
            replaced = [j for j, n in shared.items() if n >= _REVISION_OVERLAP and j not in dropped]
            if replaced:
                c.carried = c.carried or any(candidates[j].carried for j in replaced)
                c.preference = c.preference or any(candidates[j].preference for j in replaced)
                dropped.update(replaced)
        for word in c.topic:
            by_word.setdefault(word, []).append(k)
    return [c for k, c in enumerate(candidates) if k not in dropped]


def fact_lines(
    messages: Iterable[Message], *, max_facts: int = 24, max_chars: int = 2400, fact_chars: int = 200
) -> list[str]:
    """Deduplicated fact lines of ``messages`` (oldest first as given), best first, within budget.

    Rank: a stated preference or decision first, then the number of anchors weighted by how often
    they are referenced across the rows, then recency. A candidate whose anchors are all covered by
    a fact already chosen is skipped (no two lines for one hostname). A fact a later one revises is
    dropped, and the revision takes its rank (``_supersede``).
    """
    rows = list(messages)
    candidates: list[_Candidate] = []
    refs: Counter[str] = Counter()
    for i, m in enumerate(rows):
        if m.flags.is_summary:
            for fact in carried_facts(m.content):
                anchors = frozenset(_anchors(fact))
                refs.update(anchors)
                # A carried revision replaced what it revises when it was first chosen; carried facts
                # are listed by rank, not by time, so it is not taken for a revision of them again.
                candidates.append(_Candidate(fact, anchors, bool(_PREFERENCE.search(fact)), i, False, carried=True))
            continue
        per_tool: list[_Candidate] = []
        for sentence in _sentences(m):
            # An error word in conversation is chatter; an error line in tool output is a fact.
            anchors = frozenset(_anchors(sentence, errors=m.role is Role.TOOL))
            preference = m.role is Role.USER and bool(_PREFERENCE.search(sentence))
            refs.update(anchors)
            if not anchors and not preference:
                continue
            # (of the line as it is kept: a sentence of a few KB costs no more than its fact line)
            text = _clip(sentence, fact_chars)
            revision = m.role is not Role.TOOL and (
                _REVISION.search(text) is not None or (m.role is Role.USER and _USER_REVISION.search(text) is not None)
            )
            c = _Candidate(text, anchors, preference, i, m.role is Role.USER, revision=revision)
            (per_tool if m.role is Role.TOOL else candidates).append(c)
        # A long tool output contributes its few best lines, not every line with a number.
        per_tool.sort(key=lambda c: -len(c.anchors))
        candidates.extend(per_tool[:4])
    candidates = _supersede(candidates)

    def score(c: _Candidate) -> tuple[float, int]:
        # Concrete anchors (ids, hosts, paths, names, dates...) weigh most; an error word alone is
        # weak (chatter mentions errors all the time). A carried fact was chosen before and keeps
        # its place against newer chatter: facts must survive many folds, not only the next one.
        strong = [x for x in c.anchors if not x.startswith("error:")]
        weight = sum(min(refs[x], 4) for x in strong)
        value = 10.0 * c.preference + 1.0 * c.from_user + 3.0 * min(len(strong), 4) + 0.5 * weight
        value += 0.5 * (len(c.anchors) > len(strong)) + 6.0 * c.carried
        return (value, c.recency)

    chosen: list[str] = []
    seen_text: set[str] = set()
    covered: set[str] = set()
    used = 0
    for c in sorted(candidates, key=score, reverse=True):
        key = _SPACES.sub(" ", c.text).casefold()
        # Another line naming the same anchors is skipped (no two lines for one hostname), unless
        # it is a preference or a fact carried from an earlier summary: "don't forget to back up
        # db-3" must not drop "db-3 is the database host, port 5432" for sharing its host.
        if key in seen_text or (c.anchors and c.anchors <= covered and not (c.preference or c.carried)):
            continue
        if used + len(c.text) + 3 > max_chars or len(chosen) >= max_facts:
            break
        seen_text.add(key)
        covered |= c.anchors
        chosen.append(c.text)
        used += len(c.text) + 3
    return chosen


def facts_block(facts: Sequence[str]) -> str:
    """The ``Facts:`` section as text (empty when there are none)."""
    if not facts:
        return ""
    return "\n".join([FACTS_HEADER, *("- " + f for f in facts)])
