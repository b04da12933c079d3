"""Clearing that falls short, then hard truncation, on every store kind (issue #8 follow-up).

When clearing old tool results does not reach the target, hard truncation starts from the cleared
context and the report names both stages. The placeholders of that clearing are new rows, not yet
stored: whichever of them truncation drops are simply not appended, and the store is only ever
asked to demote rows it holds. When the newest tool group alone is still over the hard-truncate
level, truncation's own last-resort clearing adds placeholders of its own; both clearings must
reach the commit (bench/compression crashed with ``NotFound: message not found`` here, the first
stage's placeholders having been passed to the store as rows to demote).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from contextsvc.core.compression.cheap import is_placeholder
from contextsvc.core.legal import is_legal
from contextsvc.core.messages import Role
from contextsvc.engine.compaction import Method
from tests.support.compaction_harness import DisplayLedger, Rig, a, overrides, t, u
from tests.support.postgres import postgres_dsn
from tests.support.stores import STORE_KINDS, Backing, fixture_args, store_kind

__all__ = ["postgres_dsn"]  # the fixture the postgres kind requests

CLEAR_ONLY = overrides(strategies=["clear_tool_results"])


@pytest.fixture(params=[kind.name for kind in STORE_KINDS])
async def backing(request: pytest.FixtureRequest) -> AsyncIterator[Backing]:
    kind = store_kind(request.param)
    made = await kind.make(**fixture_args(kind, request.getfixturevalue))
    try:
        yield made
    finally:
        await made.dispose()


async def _history(rig: Rig, sid: str, ledger: DisplayLedger, *, newest_results: int, newest_size: int) -> None:
    """Five turns of conversation with small tool results (clearing them falls short of the
    target), then an open turn whose one parallel tool group carries ``newest_results`` results
    of about ``newest_size`` tokens each."""
    for k in range(5):
        seqs = await rig.append(
            sid,
            u(rig.sized(300, prefix=f"zq{k}ux ask {k}", role=Role.USER)),
            a("", (f"c{k}", "read_file")),
            t(f"c{k}", rig.sized(300, prefix=f"zq{k}tx")),
            a(rig.sized(300, prefix=f"zq{k}ax answer {k}", role=Role.ASSISTANT)),
        )
        await ledger.record(rig, sid, seqs)
    calls = [(f"p{j}", "read_file") for j in range(newest_results)]
    seqs = await rig.append(
        sid,
        u(rig.sized(100, prefix="zqlastux last ask", role=Role.USER)),
        a("", *calls),
        *[t(cid, rig.sized(newest_size, prefix=f"zqp{j}tx")) for j, (cid, _) in enumerate(calls)],
    )
    await ledger.record(rig, sid, seqs)


async def _check_commit(rig: Rig, sid: str, ledger: DisplayLedger, report: object) -> list[Method]:
    from contextsvc.engine.compaction import CompressionReport

    assert isinstance(report, CompressionReport)
    assert report.compressed, report.refused
    assert report.method is Method.HARD_TRUNCATE
    methods = [s.method for s in report.stages]
    assert methods == [Method.CLEAR_TOOL_RESULTS, Method.HARD_TRUNCATE]
    clear, cut = report.stages
    assert clear.tokens_before == report.context_tokens_before
    assert clear.tokens_after == cut.tokens_before < clear.tokens_before
    assert cut.tokens_after == report.context_tokens_after < cut.tokens_before
    assert clear.messages_removed > 0 and cut.messages_removed > 0

    # The display history is intact: no row rewritten or lost, only compression records added.
    await ledger.check(rig, sid)
    # The stored context is legal, within the hard-truncate level and every row in it is stored.
    context = await rig.context(sid)
    assert is_legal(context), [(m.sequence_number, m.role.value) for m in context]
    assert all(m.sequence_number > 0 for m in context)
    level = rig.settings.summarizer.hard_truncate_fraction * rig.window
    assert report.context_tokens_after <= level
    assert await rig.estimate(sid) <= level
    # Each placeholder in the context stands for a demoted original still in the display history.
    rows = {m.sequence_number: m for m in await rig.rows(sid)}
    for m in context:
        if is_placeholder(m):
            original = rows[m.context_anchor or 0]
            assert original.flags.is_display and not original.flags.is_context
    # The last user ask survives; the event names both stages.
    assert any(m.role is Role.USER and "last ask" in m.content for m in context)
    event = rig.events(sid, "context_compressed")[-1]
    assert [s["method"] for s in event.payload["stages"]] == ["clear_tool_results", "hard_truncate"]
    return methods


async def test_truncation_after_a_short_clearing_commits_on_every_store(backing: Backing) -> None:
    """Truncation drops old turns holding the first stage's (unsaved) placeholders."""
    rig = await Rig.over(backing)
    try:
        sid = await rig.session()
        ledger = DisplayLedger()
        await _history(rig, sid, ledger, newest_results=2, newest_size=900)
        report = await rig.compress(sid, profile=CLEAR_ONLY)
        await _check_commit(rig, sid, ledger, report)
    finally:
        await rig.close()


async def test_a_second_clearing_inside_truncation_keeps_both_on_every_store(backing: Backing) -> None:
    """The newest tool group alone is over the level: truncation clears some of its results too,
    on top of the first stage's placeholders that it dropped with the old turns."""
    rig = await Rig.over(backing)
    try:
        sid = await rig.session()
        ledger = DisplayLedger()
        await _history(rig, sid, ledger, newest_results=3, newest_size=1500)
        report = await rig.compress(sid, profile=CLEAR_ONLY)
        await _check_commit(rig, sid, ledger, report)
        context = await rig.context(sid)
        newest = [m for m in context if m.role is Role.TOOL and (m.tool_call_id or "").startswith("p")]
        assert len(newest) == 3 and any(is_placeholder(m) for m in newest)
        # Each placeholder was appended once.
        anchors = [m.context_anchor for m in context if is_placeholder(m)]
        assert len(anchors) == len(set(anchors))
    finally:
        await rig.close()
