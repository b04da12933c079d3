"""Reading the files store's start-up index: lines are checked one by one and parsed in one go,
and a line that would break the batch costs only its own session (``stores/_index.py``)."""

from __future__ import annotations

from pathlib import Path

from contextsvc.core.session import SessionInfo
from contextsvc.stores._frames import frame
from contextsvc.stores._index import IndexEntry, encode_entry, index_bytes, read_index


def entry(n: int) -> IndexEntry:
    info = SessionInfo(
        id=f"00000000-0000-4000-8000-{n:012d}",
        user_id="alice",
        profile_id="p",
        name=f"session {n}",
        metadata={"team": "a", "n": n},
        state={"cycle": n},
        display_message_count=n,
        context_message_count=n,
        last_sequence=n,
        preview=f"last {n}",
    )
    return IndexEntry(info, (n, 10 * n, 100 * n, 1000 * n), n % 3)


def write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(index_bytes(lines, 160))


def test_every_entry_reads_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "index.jsonl"
    entries = [entry(n) for n in range(1, 50)]
    write(path, [encode_entry(e) for e in entries])
    read = read_index(path, 160)
    assert read is not None and len(read) == 49
    for e in entries:
        got = read[e.info.id]
        assert got.info == e.info and got.key == e.key and got.overhead == e.overhead
        assert got.line == encode_entry(e)  # kept verbatim, written again as is


def test_a_checked_line_that_is_not_one_object_costs_only_itself(tmp_path: Path) -> None:
    # Checksums hold for all three bad lines, but joined into one array they would shift every
    # entry after them (two objects) or break the parse (not JSON, not an object).
    path = tmp_path / "index.jsonl"
    good = [encode_entry(entry(n)) for n in range(1, 7)]
    bad = [frame(b'{"a":1},{"b":2}'), frame(b"[1,2"), frame(b"7")]
    write(path, [good[0], bad[0], good[1], good[2], bad[1], good[3], bad[2], good[4], good[5]])
    read = read_index(path, 160)
    assert read is not None
    assert sorted(read) == sorted(entry(n).info.id for n in range(1, 7))
    assert read[entry(4).info.id].info == entry(4).info


def test_a_line_failing_its_checksum_or_unwrapped_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "index.jsonl"
    lines = [encode_entry(entry(n)) for n in range(1, 5)]
    lines[1] = lines[1].replace(b'"q":2', b'"q":9')  # checksum no longer matches
    lines[2] = lines[2][lines[2].index(b'"r":') + 4 : -2] + b"\n"  # the bare record, no wrapper
    write(path, lines)
    read = read_index(path, 160)
    assert read is not None and sorted(read) == sorted([entry(1).info.id, entry(4).info.id])
