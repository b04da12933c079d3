"""Checks of what the engine returned, written independently of ``contextsvc.core.legal``.

A benchmark that reused the engine's own legality code could not catch that code's mistakes, so
the rules are restated here from DESIGN §2/§5.2 and applied to every view and context buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from contextsvc.core.messages import Message, Role


def view_problems(view: Sequence[Message]) -> list[str]:
    """Why ``view`` is not a legal chat sequence ([] when it is).

    Legal: system rows only at the head; the conversation starts at a user message; every tool
    result answers a call of the assistant message heading its run, once; every call is answered
    before the next non-tool row (only the very last message may hold unanswered calls).
    """
    problems: list[str] = []
    i = 0
    while i < len(view) and view[i].role is Role.SYSTEM:
        i += 1
    if i < len(view) and view[i].role is not Role.USER:
        problems.append(f"conversation starts with {view[i].role.value} #{view[i].sequence_number}")
    open_calls: set[str] = set()
    opener: Message | None = None
    for m in view[i:]:
        if m.role is Role.SYSTEM:
            problems.append(f"system row #{m.sequence_number} inside the conversation")
            continue
        if m.role is Role.TOOL:
            if m.tool_call_id not in open_calls:
                problems.append(f"orphan tool result #{m.sequence_number} (call {m.tool_call_id})")
            open_calls.discard(m.tool_call_id)
            continue
        if open_calls and opener is not None:
            problems.append(f"#{opener.sequence_number}: calls {sorted(open_calls)} without results")
        open_calls = {c.id for c in m.tool_calls} if m.role is Role.ASSISTANT else set()
        opener = m
    # Unanswered calls are allowed only when their assistant message is the last row (pending).
    if open_calls and opener is not None and view[-1] is not opener:
        problems.append(f"#{opener.sequence_number}: calls {sorted(open_calls)} without results")
    return problems


def split_groups(view: Sequence[Message], stored: Mapping[int, Message]) -> list[str]:
    """Tool-call groups the view shows incompletely compared with the stored rows.

    The engine repairs an illegal context rather than failing, so a group split in the context
    buffer shows up as an assistant message that lost calls in the view (still "legal"). Catch it.
    """
    out: list[str] = []
    for m in view:
        if m.role is not Role.ASSISTANT or m.sequence_number <= 0:
            continue
        original = stored.get(m.sequence_number)
        if original is None:
            continue
        lost = {c.id for c in original.tool_calls} - {c.id for c in m.tool_calls}
        if lost:
            out.append(f"#{m.sequence_number} lost calls {sorted(lost)} in the view")
    return out


def context_split_groups(context: Sequence[Message]) -> list[str]:
    """Groups split inside the stored context buffer: a call whose result is not in the buffer, or a
    result whose call is not (a cleared result's placeholder answers its call like the original)."""
    calls: dict[str, int] = {}
    results: dict[str, int] = {}
    for m in context:
        if m.role is Role.ASSISTANT:
            for c in m.tool_calls:
                calls[c.id] = m.sequence_number
        elif m.role is Role.TOOL and m.tool_call_id:
            results[m.tool_call_id] = m.sequence_number
    out = [f"call {cid} (#{seq}) has no result in the context" for cid, seq in calls.items() if cid not in results]
    out += [f"result #{seq} answers call {cid}, not in the context" for cid, seq in results.items() if cid not in calls]
    return out


def dropped_rows(view: Sequence[Message], context: Sequence[Message]) -> list[int]:
    """Context rows (not records) the view left out: the repair dropped them."""
    shown = {m.sequence_number for m in view}
    return [m.sequence_number for m in context if m.role is not Role.SYSTEM and m.sequence_number not in shown]


@dataclass(frozen=True)
class Compaction:
    """One ``context_compressed`` event, in stream order. ``after_truncation``: a post-turn compaction,
    the first after a ``context_truncated`` event (DESIGN §5.3: the post-turn check then compresses
    regardless of the threshold). ``before``: the view's estimate the trigger compared (the event's
    ``estimate_tokens``; before round 8 its ``context_tokens_before``); ``margin``: the margin the
    trigger added to it; ``aim`` and ``rate``: where the engine aimed the estimate and the margin
    rate it assumed for the view it left (0 / 0.0 when the event does not say); ``priced``: the
    view before, priced whole as ``after`` is (``context_tokens_before``; 0: not said)."""

    reason: str
    method: str
    before: int
    after: int
    after_truncation: bool = False
    turn: int = -1  # the turn the runtime was playing when the event arrived
    margin: int = 0
    aim: int = 0
    rate: float = 0.0
    priced: int = 0


@dataclass(frozen=True)
class BandCheck:
    pairs: int
    #: pairs inside the band whose later compaction no rule exempts.
    violations: list[str]
    #: pairs inside the band whose later compaction was the post-turn answer to a truncated prompt.
    after_truncation: list[str]
    min_growth: int | None
    #: pairs inside the band whose later compaction answered estimate + margin at the budget, in
    #: one of the two cases the design exempts (docs/calibration.md), with the case.
    budget_exempt: list[str] = field(default_factory=list)


#: why a crossing of the budget inside the band is exempt (docs/calibration.md, "The hysteresis band").
ABOVE_AIM = "the compaction before ended above its aim"
WIDER_MARGIN = "the view's margin is a larger share of it than the rate the compaction before aimed for"


def budget_exemption(prev: Compaction, cur: Compaction, budget: int) -> str | None:
    """The design's reason ``cur`` may come inside the band, or None.

    The design: a crossing of the size guard's budget by estimate + margin is always compacted,
    and a compaction on a budget-triggered window aims the estimate at ``budget / (1 + rate) -
    band``. If the compaction before ended at or under its aim and ``cur``'s margin is at most
    ``rate`` of its estimate, ``before x (1 + rate) >= budget`` gives ``before - after >= band``:
    a crossing inside the band is then impossible. So it is exempt exactly when estimate + margin
    reached the budget and one of those two premises failed — checked here on the event's own
    numbers, never on the engine's say-so."""
    if cur.before + cur.margin < budget:
        return None
    if prev.after > prev.aim:
        return f"{ABOVE_AIM} ({prev.after} > {prev.aim})"
    if cur.margin > prev.rate * cur.before:
        return f"{WIDER_MARGIN} ({cur.margin / max(cur.before, 1):.3f} > {prev.rate:.3f})"
    return None


def hysteresis(compactions: Sequence[Compaction], band: int, budget: int | None = None) -> BandCheck:
    """DESIGN §5.4: never two compactions without ``band`` tokens of growth in between, unless the
    later one is forced. Growth = the view estimate that triggered compaction k+1 minus the
    context left by compaction k (both as the engine reported them). With ``budget`` (a window
    whose trigger is the size guard's budget), a crossing of it the design exempts
    (``budget_exemption``) is counted apart, with its reason."""
    violations: list[str] = []
    truncated: list[str] = []
    exempt: list[str] = []
    growths: list[int] = []
    pairs = 0
    for k in range(1, len(compactions)):
        prev, cur = compactions[k - 1], compactions[k]
        if cur.reason == "forced":
            continue
        pairs += 1
        growth = cur.before - prev.after
        growths.append(growth)
        if growth < band:
            text = (
                f"turn {cur.turn}: compaction {k + 1} ({cur.reason}/{cur.method}) after {prev.reason}/{prev.method}: "
                f"grew {growth} < {band} tokens ({prev.after} -> {cur.before})"
            )
            why = budget_exemption(prev, cur, budget) if budget is not None else None
            if cur.after_truncation:
                truncated.append(text)
            elif why is not None:
                exempt.append(f"{text}, estimate + margin {cur.before} + {cur.margin} >= {budget}: {why}")
            else:
                violations.append(text)
    return BandCheck(pairs, violations, truncated, min(growths) if growths else None, exempt)
