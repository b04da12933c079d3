"""``EngineState.of`` parses a session's state mapping once per mapping: reads of an unchanged
session share the parse, a changed session (a new mapping) is parsed again, and an equal but
distinct mapping (a store that builds one per read) gives an equal state."""

from __future__ import annotations

from contextsvc.core.session import SessionInfo
from contextsvc.engine.state import BaselineState, EngineState


def _info(state: dict[str, object]) -> SessionInfo:
    return SessionInfo(id="s", user_id="u", profile_id="", state=state)


def test_reads_of_one_mapping_share_the_parse_and_a_new_mapping_is_parsed_again() -> None:
    state = {"epoch": 2, "baseline": {"tokens": 900, "last_sequence": 7, "view_id": "v"}, "profile": {"a": 1}}
    first = EngineState.of(_info(state))
    assert first == EngineState(baseline=BaselineState(900, 7, "v"), epoch=2, extra={"profile": {"a": 1}})
    assert EngineState.of(_info(state)) is first  # the same mapping: the same parse
    changed = EngineState(epoch=3).to_dict()  # what a write leaves: a new mapping
    assert EngineState.of(_info(changed)) == EngineState(epoch=3)
    copy = {"epoch": 2, "baseline": {"tokens": 900, "last_sequence": 7, "view_id": "v"}, "profile": {"a": 1}}
    again = EngineState.of(_info(copy))
    assert again == first and again is not first


def test_the_kept_parses_stay_bounded() -> None:
    from contextsvc.engine import state as module

    for k in range(module._PARSED_MAX + 10):
        assert EngineState.of(_info({"epoch": k})).epoch == k
    assert len(module._parsed) <= module._PARSED_MAX
