"""A session deleted while its post-turn check runs (DeleteSession on this replica or another,
between the check's reads) ends the check quietly: no warning, no traceback in the log; a store
that goes down meanwhile makes one warning line, no traceback."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from contextsvc.core.session import ANONYMOUS
from contextsvc.errors import Unavailable
from tests.support.compaction_harness import ContextReadingStore, Rig, a, u, words


class DownMidCheckStore(ContextReadingStore):
    """The store goes down at the check's context read, as PostgreSQL restarting would."""

    down: bool = False

    async def load_context(self, session_id: str, *, caller: Any) -> Any:
        if self.down:
            raise Unavailable("the session store is not reachable")
        return await super().load_context(session_id, caller=caller)

    async def context_and_session(self, session_id: str, *, caller: Any) -> Any:
        if self.down:
            raise Unavailable("the session store is not reachable")
        return await super().context_and_session(session_id, caller=caller)

    async def get_session(self, session_id: str, *, caller: Any) -> Any:
        if self.down:
            raise Unavailable("the session store is not reachable")
        return await super().get_session(session_id, caller=caller)


class DeletedMidCheckStore(ContextReadingStore):
    """Deletes the session at the check's context read, as a concurrent DeleteSession would."""

    delete_on_read: str = ""

    async def load_context(self, session_id: str, *, caller: Any) -> Any:
        if session_id == self.delete_on_read:
            await self.delete_session(session_id, caller=ANONYMOUS)
        return await super().load_context(session_id, caller=caller)

    async def context_and_session(self, session_id: str, *, caller: Any) -> Any:
        if session_id == self.delete_on_read:
            await self.delete_session(session_id, caller=ANONYMOUS)
        return await super().context_and_session(session_id, caller=caller)


async def _check_with(
    store_class: type[ContextReadingStore],
    arm: Callable[[Any, str], None],
    caplog: pytest.LogCaptureFixture,
) -> tuple[ContextReadingStore, list[logging.LogRecord]]:
    """Run one post-turn check of a fresh session with ``arm(store, session_id)`` applied just
    before it; the store and what the check logged."""
    rig = await Rig.start(store=store_class, hot_path={"post_turn_headroom": 0})
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"), a("hi " + words(20)))
        assert await rig.engine.post_turn.drain(5)
        store = rig.store
        assert isinstance(store, store_class)
        arm(store, sid)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="contextsvc"):
            rig.engine.post_turn.schedule(sid)
            assert await rig.engine.post_turn.drain(5)
        records = list(caplog.records)
        arm(store, "")
        return store, records
    finally:
        await rig.close()


async def test_a_session_deleted_during_its_post_turn_check_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    def arm(store: Any, sid: str) -> None:
        store.delete_on_read = sid

    store, records = await _check_with(DeletedMidCheckStore, arm, caplog)
    assert store.context_reads >= 1  # the check got as far as the context read
    noisy = [rec for rec in records if rec.levelno >= logging.WARNING]
    assert not noisy, [(rec.getMessage(), rec.exc_info is not None) for rec in noisy]


async def test_a_store_down_during_a_post_turn_check_logs_one_line_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def arm(store: Any, sid: str) -> None:
        store.down = bool(sid)

    _, records = await _check_with(DownMidCheckStore, arm, caplog)
    lines = [rec for rec in records if rec.name == "contextsvc.engine.worker"]
    assert [rec.levelno for rec in lines] == [logging.WARNING]
    assert lines[0].exc_info is None and "not reachable" in lines[0].getMessage()
