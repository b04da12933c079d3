"""Reading the files store's start-up index: lines are checked one by one and parsed in one go,
and a line that would break the batch costs only its own session (``stores/_index.py``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import contextsvc.stores._index as index_module
from contextsvc.core.codec import session_to_dict
from contextsvc.core.session import SessionInfo
from contextsvc.stores._frames import frame
from contextsvc.stores._index import INDEX_FORMAT, IndexEntry, encode_entry, index_bytes, read_index
from contextsvc.stores._session import SessionState


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
    assert b'"session 2"' in lines[1]
    write(path, lines)
    # Damage after the write (the header's checksum of the whole no longer matches either).
    data = path.read_bytes()
    data = data.replace(b'"session 2"', b'"session 9"')  # that line's checksum no longer matches
    data = data.replace(lines[2], lines[2][lines[2].index(b'"r":') + 4 : -2] + b"\n")  # no wrapper
    path.write_bytes(data)
    read = read_index(path, 160)
    assert read is not None and sorted(read) == sorted([entry(1).info.id, entry(4).info.id])


def test_an_intact_index_is_read_without_checking_each_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The header's CRC32C of everything after it vouches for every line at once.
    path = tmp_path / "index.jsonl"
    entries = [entry(n) for n in range(1, 6)]
    write(path, [encode_entry(e) for e in entries])
    checked: list[bytes] = []
    real = index_module.checked_body
    monkeypatch.setattr(index_module, "checked_body", lambda raw: checked.append(raw) or real(raw))
    read = read_index(path, 160)
    assert read is not None and sorted(read) == sorted(e.info.id for e in entries)
    assert checked == []
    # One byte changed anywhere after the header: every line is checked, the bad one left out.
    data = path.read_bytes().replace(b'"session 3"', b'"session 8"')
    path.write_bytes(data)
    read = read_index(path, 160)
    assert read is not None and sorted(read) == sorted(e.info.id for e in entries if e.info.name != "session 3")
    assert len(checked) == 5


def test_an_index_written_without_the_whole_checksum_is_checked_line_by_line(tmp_path: Path) -> None:
    # The header written before the whole checksum existed has no "crc": each line's check decides.
    path = tmp_path / "index.jsonl"
    lines = [encode_entry(entry(n)) for n in range(1, 4)]
    head = frame(json.dumps({"t": "index", "format": INDEX_FORMAT, "preview_chars": 160}).encode())
    path.write_bytes(head + lines[0] + lines[1].replace(b'"session 2"', b'"session 7"') + lines[2])
    read = read_index(path, 160)
    assert read is not None and sorted(read) == sorted([entry(1).info.id, entry(3).info.id])
    assert read.current is False  # the store writes it again, with the whole checksum


def test_an_entry_read_makes_the_same_summary_as_its_info(tmp_path: Path) -> None:
    # Start-up builds the store's summary from the record's values (no SessionInfo between):
    # it must be the one SessionState.summary makes from the entry's SessionInfo, slot for slot.
    path = tmp_path / "index.jsonl"
    entries = [entry(n) for n in range(1, 4)]
    write(path, [encode_entry(e) for e in entries])
    read = read_index(path, 160)
    assert read is not None
    for e in entries:
        fast = read[e.info.id].summary_state()
        slow = SessionState.summary(e.info)
        for name in SessionState.__slots__:
            if name != "lock":
                assert getattr(fast, name) == getattr(slow, name), name
        assert fast.info(160) == e.info


def test_an_index_of_the_previous_format_is_read_and_written_anew(tmp_path: Path) -> None:
    # Format 1 (one object per session), as written before format 2: still used, so a first start
    # after an upgrade does not read every log; its lines are encoded in the current format again.
    assert INDEX_FORMAT == 2
    path = tmp_path / "index.jsonl"
    entries = [entry(n) for n in range(1, 5)]
    old = [
        frame(
            json.dumps(
                {
                    "s": session_to_dict(e.info),
                    "d": e.info.display_message_count,
                    "x": e.info.context_message_count,
                    "q": e.info.last_sequence,
                    "p": e.info.preview,
                    "o": e.overhead,
                    "k": list(e.key),
                },
                separators=(",", ":"),
            ).encode()
        )
        for e in entries
    ]
    header = frame(json.dumps({"t": "index", "format": 1, "preview_chars": 160}, separators=(",", ":")).encode())
    path.write_bytes(header + b"".join(old))
    read = read_index(path, 160)
    assert read is not None and len(read) == 4 and not read.current
    for e in entries:
        got = read[e.info.id]
        assert got.info == e.info and got.key == e.key and got.overhead == e.overhead
        assert encode_entry(got) == encode_entry(e) and encode_entry(got) not in old


def test_a_name_orjson_refuses_is_read_by_the_standard_parser(tmp_path: Path) -> None:
    # A lone surrogate is written as an ASCII escape, which orjson refuses: the standard library's
    # parser reads the whole index instead, and every entry comes back as written.
    path = tmp_path / "index.jsonl"
    odd = entry(7)
    odd = IndexEntry(dataclasses.replace(odd.info, name="half \ud800 pair"), odd.key, odd.overhead)
    entries = [entry(1), odd, entry(3)]
    write(path, [encode_entry(e) for e in entries])
    read = read_index(path, 160)
    assert read is not None and sorted(read) == sorted(e.info.id for e in entries)
    assert read[odd.info.id].info.name == "half \ud800 pair"
