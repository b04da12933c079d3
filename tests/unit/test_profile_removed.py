"""A session whose named profile an operator removed from the settings since it was created.

Its appends still store what the agent sends (priced with the default profile): refusing them lost
the agent's turn. Its builds say what is wrong, FAILED_PRECONDITION reason UNKNOWN_PROFILE naming
the profile (the request named none: INVALID_ARGUMENT on a field it never sent misled the client),
and a build that names a configured profile goes on.
"""

from __future__ import annotations

import pytest

from contextsvc.config import ProfileConfig, Settings
from contextsvc.core.messages import Message, Role
from contextsvc.core.profile import ProfileOverrides
from contextsvc.core.session import ANONYMOUS
from contextsvc.engine.engine import Engine
from contextsvc.engine.validation import IncomingMessage
from contextsvc.errors import FailedPrecondition, InvalidArgument
from contextsvc.stores.memory import MemoryData, MemoryStore
from tests.support.engines import make_engine


async def _engine(data: MemoryData, *profiles: str) -> Engine:
    settings = Settings(
        profiles={name: ProfileConfig(context_window=8192 * (k + 1)) for k, name in enumerate(profiles)},
        store="memory",
    )
    store = MemoryStore(settings, data=data)
    await store.open()
    return make_engine(store, settings)


def _turn(text: str) -> list[IncomingMessage]:
    return [IncomingMessage(Message(Role.USER, text)), IncomingMessage(Message(Role.ASSISTANT, f"re: {text}"))]


async def _build(engine: Engine, sid: str, **profile: str) -> object:
    return await engine.build_context(
        ANONYMOUS, sid, profile=ProfileOverrides(**profile), incoming=None, mid_turn=False, auto_compress=True
    )


async def test_a_session_whose_profile_was_removed_keeps_its_appends_and_says_why_it_cannot_build(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = MemoryData()
    before = await _engine(data, "default", "research")
    sid = (await before.sessions.create(ANONYMOUS, profile_id="research", name="", metadata={})).id
    await before.append(ANONYMOUS, sid, _turn("first"), request_id="", turn_complete=True)
    # The agent names the profile in its builds: the session remembers that, and Compress and the
    # post-turn check (no profile of their own) use what it remembers.
    await _build(before, sid, profile_id="research")

    after = await _engine(data, "default")  # restarted without [profiles.research]
    outcome = await after.append(ANONYMOUS, sid, _turn("second"), request_id="", turn_complete=True)
    assert list(outcome.sequence_numbers) == [3, 4]
    assert outcome.context_tokens > 0
    assert await after.post_turn.drain(5)
    assert not [r for r in caplog.records if "post-turn check" in r.getMessage()]  # nothing to judge it by
    with pytest.raises(FailedPrecondition) as failed:
        await _build(after, sid)
    assert failed.value.reason == "UNKNOWN_PROFILE"
    assert failed.value.metadata == {"profile_id": "research"}
    assert "research" in failed.value.message and "profile.profile_id" in failed.value.message
    # So does a Compress that names no profile (it uses the remembered one).
    with pytest.raises(FailedPrecondition) as failed:
        await after.compress(ANONYMOUS, sid, profile=ProfileOverrides(), note="", dry_run=True)
    assert failed.value.reason == "UNKNOWN_PROFILE"
    # Naming a configured profile builds the session, every row kept.
    view = await _build(after, sid, profile_id="default")
    assert [vm.message.content for vm in view.messages] == ["first", "re: first", "second", "re: second"]
    # A request naming a profile nobody configured is the request's error, as before.
    with pytest.raises(InvalidArgument) as invalid:
        await _build(after, sid, profile_id="nope")
    assert invalid.value.reason == "UNKNOWN_PROFILE"
    # A fork of it counts its rows too.
    fork = await after.sessions.fork(ANONYMOUS, sid, at_sequence=0)
    assert fork.context_tokens > 0
