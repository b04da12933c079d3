"""A restart gives back exactly the same two buffers, counters, views and observations."""

from __future__ import annotations

import dataclasses
from typing import Any

from contextsvc.core.calibration import Observation
from contextsvc.core.messages import Message
from contextsvc.ports import SessionStore
from tests.conformance.helpers import (
    ADMIN,
    ALICE,
    BOB,
    Reopen,
    assistant,
    compression_record,
    image,
    snapshot,
    summary,
    tool,
    user,
    view,
)


def _agent_turns(n: int) -> list[Message]:
    """``n`` messages of realistic turns: a question with an image, a tool-call group, an answer."""
    out: list[Message] = []
    turn = 0
    while len(out) < n:
        turn += 1
        ask = dataclasses.replace(user(f"question {turn}: what is in dir{turn}? ünïcödé ✓"), images=(image(turn),))
        if turn % 7 == 0:
            ask = ask.with_flags(is_pinned=True)
        out.append(ask)
        out.append(dataclasses.replace(assistant("", f"t{turn}a", f"t{turn}b"), thinking=f"plan {turn}"))
        out.append(tool(f"t{turn}a", f"file_{turn}.txt\n" * 3))
        out.append(tool(f"t{turn}b", '{"json": [1, 2, "three"]}'))
        out.append(dataclasses.replace(assistant(f"dir{turn} holds file_{turn}.txt"), metadata={"turn": turn}))
    return out[:n]


async def _everything(store: SessionStore, sids: list[str]) -> dict[str, Any]:
    state: dict[str, Any] = {sid: await snapshot(store, sid) for sid in sids}
    state["views"] = [await store.get_view(sids[0], f"v{i}") for i in range(6)]
    state["observations"] = {
        model: await store.list_calibration_observations(model, limit=50) for model in ("gpt", "llama")
    }
    state["listing"] = await store.list_sessions(caller=ADMIN, offset=0, limit=10)
    return state


async def test_a_200_message_agent_session_reloads_identically(store: SessionStore, reopen: Reopen) -> None:
    sid = (await store.create_session(caller=ALICE, profile_id="agent", name="long", metadata={"team": "x"})).id
    other = (await store.create_session(caller=BOB, profile_id="agent", name="other")).id
    history = _agent_turns(200)
    for i in range(0, 200, 25):
        await store.append_messages(
            sid, history[i : i + 25], caller=ALICE, request_id=f"batch-{i}", context_tokens_delta=100 + i
        )
        await store.append_messages(other, [user(f"bob {i}")], caller=BOB)
    # Two compactions: the second demotes the first summary (a context-only row).
    await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[s for s in range(1, 51) if s != 31],  # the pinned asks (turns 7 and 14: 31, 66) stay
        append=[summary("summary of 1-50", anchor=1, replaces=(1, 50)), compression_record("compressed 1-50")],
        context_tokens=900,
        state={"epoch": 1, "baseline": None},
    )
    await store.commit_compaction(
        sid,
        caller=ALICE,
        demote=[201, *(s for s in range(51, 101) if s != 66)],
        append=[summary("summary of 1-100", anchor=1, replaces=(1, 100)), compression_record("compressed 1-100")],
        context_tokens=700,
        state={"epoch": 2},
    )
    await store.set_context_flags(sid, [150, 151], caller=ALICE, is_context=False)
    await store.set_context_flags(sid, [150], caller=ALICE, is_context=True)
    await store.update_session(sid, caller=ALICE, pinned=True, name="long session")
    await store.update_state(sid, caller=ALICE, context_truncated=True)
    for i in range(6):
        await store.save_view(sid, view(f"v{i}", last_sequence=200 + i, epoch=2), keep=4)
    for tokens in (100, 150, 210):
        await store.add_calibration_observation("gpt", Observation(chars=tokens * 4, tokens=tokens))
    await store.add_calibration_observation("llama", Observation(chars=800, tokens=300, had_images=True))

    before = await _everything(store, [sid, other])
    info = before[sid]["info"]
    assert (info.last_sequence, info.display_message_count) == (204, 202)
    assert before[sid]["rows"][199].content == "dir40 holds file_40.txt"
    assert before["views"][:2] == [None, None] and before["views"][5] is not None

    store = await reopen()
    assert await _everything(store, [sid, other]) == before
    # And the reloaded store goes on numbering where the first one stopped.
    result = await store.append_messages(sid, [user("after restart")], caller=ALICE)
    assert result.sequence_numbers == [205]
