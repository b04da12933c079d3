"""What the PostgreSQL store's context cache decides, without a database (``context_cache.py``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from contextsvc.core.messages import Message, Role
from contextsvc.stores._session import row_bytes
from contextsvc.stores.postgres.context_cache import (
    ENTRY_BYTES,
    ContextCache,
    ContextVersion,
    KeyedRow,
    extended,
    whole,
)

BORN = datetime(2026, 12, 1, tzinfo=UTC)


def rows(*seqs: int, anchor: dict[int, int] | None = None) -> list[KeyedRow]:
    anchors = anchor or {}
    return [((anchors.get(s, s), s), Message(Role.USER, f"m{s}", sequence_number=s)) for s in seqs]


def version(epoch: int = 0, last: int = 3, born: datetime = BORN) -> ContextVersion:
    return ContextVersion(born, epoch, last)


def test_a_whole_read_is_cached_only_when_its_rows_add_up_to_the_count() -> None:
    entry = whole(version(), rows(1, 2, 3), 3)
    assert entry is not None and [m.sequence_number for m in entry.rows] == [1, 2, 3]
    assert entry.last_key == (3, 3)
    assert entry.nbytes == ENTRY_BYTES + sum(row_bytes(m) for _, m in rows(1, 2, 3))
    assert whole(version(), rows(1, 2, 3), 4) is None
    empty = whole(version(last=0), [], 0)
    assert empty is not None and empty.rows == () and empty.last_key == (0, 0)


def test_rows_appended_since_extend_the_held_ones_in_place() -> None:
    held = whole(version(), rows(1, 2, 3), 3)
    assert held is not None
    grown = extended(held, version(last=5), rows(4, 5), 5)
    assert grown is not None and grown.version == version(last=5)
    assert all(a is b for a, b in zip(held.rows, grown.rows[:3], strict=True))
    assert [m.sequence_number for m in grown.rows] == [1, 2, 3, 4, 5] and grown.last_key == (5, 5)
    # Appends outside the context (display only): a new version, the same rows.
    same = extended(held, version(last=4), [], 3)
    assert same is not None and same.rows is held.rows and same.version.last_sequence == 4
    assert extended(held, version(), [], 3) is held


def test_any_other_change_means_a_whole_read() -> None:
    held = whole(version(), rows(1, 2, 3), 3)
    assert held is not None
    assert extended(held, version(epoch=1, last=4), rows(4), 4) is None  # flags changed
    assert extended(held, version(last=4, born=BORN + timedelta(seconds=1)), rows(4), 4) is None  # created again
    assert extended(held, version(last=2), [], 3) is None  # fewer rows than held
    assert extended(held, version(last=4), rows(4), 3) is None  # the count does not add up
    assert extended(held, version(last=4), rows(4, anchor={4: 2}), 4) is None  # placed among held rows


def test_the_cache_keeps_the_newest_version_and_drops_least_recently_used_past_its_budget() -> None:
    one = whole(version(), rows(1, 2, 3), 3)
    assert one is not None
    cache = ContextCache(budget_bytes=2 * one.nbytes)
    cache.put("a", one)
    newer = extended(one, version(last=4), rows(4), 4)
    assert newer is not None
    cache.put("a", newer)
    cache.put("a", one)  # an older read that finished late does not replace it
    assert cache.get("a") is newer
    cache.put("b", one)  # over the budget: "a" was used least recently
    assert cache.get("a") is None and cache.get("b") is one and cache.held_bytes == one.nbytes
    cache.put("c", one)
    cache.get("b")
    cache.put("d", one)  # "c" goes, "b" was just used
    assert cache.get("c") is None and cache.get("b") is one and cache.held_bytes <= 2 * one.nbytes
    cache.forget("b")
    assert cache.get("b") is None and cache.held_bytes == one.nbytes and len(cache) == 1
    # A session created again under its id replaces what was held whatever its numbers.
    reborn = whole(version(born=BORN + timedelta(days=1), last=1), rows(1), 1)
    assert reborn is not None
    cache.put("d", reborn)
    assert cache.get("d") is reborn


def test_a_context_larger_than_the_whole_budget_is_not_kept() -> None:
    big = whole(version(), rows(1, 2, 3), 3)
    assert big is not None
    cache = ContextCache(budget_bytes=big.nbytes - 1)
    cache.put("a", big)
    assert cache.get("a") is None and cache.held_bytes == 0
    none = ContextCache(budget_bytes=0)
    none.put("a", big)
    assert len(none) == 0


def test_a_session_vouched_for_gets_the_held_context_of_its_version_only() -> None:
    """``vouch``/``as_read``: the post-turn check after a baseline reads nothing when the anchor's
    row is of the held context's very version, and reads when anything differs."""
    from contextsvc.core.session import SessionInfo

    cache = ContextCache(1 << 20)
    held = whole(version(), rows(1, 2, 3), 3)
    assert held is not None
    cache.put("s", held)
    session = SessionInfo(id="s", user_id="u", profile_id="p", last_sequence=3)
    assert cache.as_read(session) is None  # not vouched for
    cache.vouch(session, version(last=4), 3)  # another version: not vouched
    cache.vouch(session, version(epoch=1), 3)
    cache.vouch(session, version(born=BORN + timedelta(seconds=1)), 3)
    cache.vouch(session, version(), 4)  # another count
    assert cache.as_read(session) is None
    cache.vouch(session, version(), 3)
    assert cache.as_read(session) == held.rows
    other = SessionInfo(id="s", user_id="u", profile_id="p", last_sequence=3)  # an equal, other object
    assert cache.as_read(other) is None
    assert cache.held_bytes == held.nbytes  # vouching costs no budget of its own
    grown = extended(held, version(last=5), rows(4, 5), 5)
    assert grown is not None
    cache.put("s", grown)  # a newer build's read: the vouch went with the older entry
    assert cache.as_read(session) is None
    cache.vouch(SessionInfo(id="t", user_id="u", profile_id="p"), version(), 3)  # nothing held: nothing kept
    assert len(cache) == 1
