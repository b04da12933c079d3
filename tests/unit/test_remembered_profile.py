"""The inline profile a session remembers (engine state ``profile``): stored without its unset
fields, and not at all when a build names none (a write and a lock saved per new session)."""

from __future__ import annotations

from contextsvc.api.mapping import profile_from_pb
from contextsvc.config import Settings
from contextsvc.core.profile import NO_OVERRIDES, CompressionOverrides, ProfileOverrides, resolve_profile
from contextsvc.core.session import ANONYMOUS
from tests.support.compaction_harness import Rig, a, u


async def test_a_build_without_a_profile_stores_nothing_and_one_with_it_stores_only_what_it_sets() -> None:
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"), a("hi"))
        await rig.build(sid)
        info = await rig.store.get_session(sid, caller=ANONYMOUS)
        assert "profile" not in info.state

        chosen = ProfileOverrides(system_prompt="", compression=CompressionOverrides(keep_recent=3))
        await rig.build(sid, profile=chosen)
        info = await rig.store.get_session(sid, caller=ANONYMOUS)
        assert info.state["profile"] == {"profile_id": "", "system_prompt": "", "compression": {"keep_recent": 3}}
        # Remembered: an estimate naming no profile prices with it (the empty system prompt kept).
        with_it = await rig.estimate(sid, chosen)
        assert await rig.estimate(sid) == with_it

        # A later build without one replaces it with the defaults, stored as such.
        await rig.build(sid)
        info = await rig.store.get_session(sid, caller=ANONYMOUS)
        assert info.state["profile"] == {"profile_id": ""}
    finally:
        await rig.close()


async def test_the_shared_no_overrides_object_acts_as_any_empty_overrides() -> None:
    """A request without a profile maps to ``NO_OVERRIDES`` (recognized by identity on the hot
    path); it must resolve, and be remembered, exactly as an equal ``ProfileOverrides()`` is."""
    assert profile_from_pb(None) is NO_OVERRIDES
    settings = Settings()
    for session_profile in ("", "default"):
        expected = resolve_profile(settings, session_profile, ProfileOverrides())
        assert resolve_profile(settings, session_profile, NO_OVERRIDES) == expected
        assert resolve_profile(settings, session_profile, None) == expected
    rig = await Rig.start()
    try:
        sid = await rig.session()
        await rig.append(sid, u("hello"), a("hi"))
        await rig.build(sid, profile=ProfileOverrides(compression=CompressionOverrides(keep_recent=3)))
        await rig.build(sid, profile=NO_OVERRIDES)  # replaces the remembered one, like ProfileOverrides()
        info = await rig.store.get_session(sid, caller=ANONYMOUS)
        assert info.state["profile"] == {"profile_id": ""}
        await rig.build(sid, profile=NO_OVERRIDES)  # and again: nothing new to remember
        assert (await rig.store.get_session(sid, caller=ANONYMOUS)).state == info.state
    finally:
        await rig.close()
