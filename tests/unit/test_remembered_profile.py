"""The inline profile a session remembers (engine state ``profile``): stored without its unset
fields, and not at all when a build names none (a write and a lock saved per new session)."""

from __future__ import annotations

from contextsvc.core.profile import CompressionOverrides, ProfileOverrides
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
