"""Recalled excerpts as view records (contextsvc.core.recall_view)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from contextsvc.core.messages import Role
from contextsvc.core.recall import query_terms
from contextsvc.core.recall_view import RECALL_SOURCE, covers_any, excerpt, recall_record
from contextsvc.ports import HistoryChunk

LOG = "#12 tool c3:\n" + "\n".join(
    ["12:00:01 worker ok batch 1"] * 20 + ["replica listening on 10.0.3.7 port 5433"] + ["12:00:02 worker ok"] * 20
)


def test_a_short_text_is_kept_whole() -> None:
    assert excerpt("#1 user: hello", ["hello"], 100) == "#1 user: hello"


def test_a_long_text_keeps_its_header_and_the_lines_around_the_best_one() -> None:
    cut = excerpt(LOG, query_terms("Which replica IP address?"), 120)
    assert cut.startswith("#12 tool c3:\n")
    assert "replica listening on 10.0.3.7 port 5433" in cut
    assert len(cut) <= 120
    assert cut.count("\n") >= 2  # neighbours fill the room


def test_a_single_line_longer_than_the_room_is_cut() -> None:
    cut = excerpt("#1 user:\n" + "x" * 500, ["x"], 100)
    assert cut.startswith("#1 user:\n") and cut.endswith("…") and len(cut) <= 100


@given(st.text(max_size=400), st.integers(10, 300), st.sampled_from(["", "#5 tool c1:\n", "#123456 assistant:\n"]))
def test_an_excerpt_never_exceeds_its_room(text: str, room: int, header: str) -> None:
    assert len(excerpt(header + text, query_terms(text), room)) <= room


def test_covers_any_is_a_range_check_on_sorted_numbers() -> None:
    c = HistoryChunk("h", "t", 10, 14, None, None)
    assert covers_any(c, [3, 10]) and covers_any(c, [14]) and covers_any(c, [1, 12, 99])
    assert not covers_any(c, []) and not covers_any(c, [9, 15, 20])


def test_the_record_says_where_it_comes_from_and_is_never_stored() -> None:
    c = HistoryChunk("abc", "text", 12, 15, None, None)
    m = recall_record(c, "text", 3.14159)
    assert m.role is Role.SYSTEM and m.sequence_number == 0
    assert m.flags.is_recall and not m.flags.is_context and not m.flags.is_display
    assert m.content.startswith("Recalled from earlier in this conversation (messages #12-#15")
    assert m.metadata == {
        "source": RECALL_SOURCE,
        "chunk_id": "abc",
        "first_sequence": 12,
        "last_sequence": 15,
        "score": 3.1416,
    }
    one = recall_record(HistoryChunk("d", "x", 7, 7, None, None), "x", 1.0)
    assert "(message #7," in one.content


def test_recall_settings_merge_per_profile_and_survive_the_remembered_profile() -> None:
    import dataclasses
    import json

    import pytest

    from contextsvc.config import Settings
    from contextsvc.core.profile import ProfileOverrides, RecallOverrides, resolve_profile
    from contextsvc.engine.remembered_profile import overrides_from_dict
    from contextsvc.errors import InvalidArgument

    base = resolve_profile(Settings(), "", None).recall
    assert (base.enabled, base.max_excerpts, base.max_tokens, base.min_score) == (True, 2, 1024, 0.5)
    wanted = ProfileOverrides(recall=RecallOverrides(enabled=False, max_excerpts=1))
    merged = resolve_profile(Settings(), "", wanted).recall
    assert (merged.enabled, merged.max_excerpts, merged.max_tokens) == (False, 1, 1024)
    with pytest.raises(InvalidArgument) as err:
        resolve_profile(Settings(), "", ProfileOverrides(recall=RecallOverrides(min_score=1.5)))
    assert "profile.recall" in str(err.value.metadata) or "profile.recall" in str(err.value)
    # BuildContext remembers inline overrides as JSON; the recall part comes back typed.
    stored = json.loads(json.dumps(dataclasses.asdict(wanted)))
    assert overrides_from_dict(stored) == wanted
