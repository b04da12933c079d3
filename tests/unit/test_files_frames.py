"""Checked lines and sequence marks of the files store (``stores/_frames.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextsvc.stores._frames import BadFrame, frame, read_mark, unframe, write_mark, write_mark_number

records = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=40)), max_size=6)


def _line(record: dict[str, object]) -> bytes:
    return frame(json.dumps(record, separators=(",", ":")).encode())[:-1]


@given(records)
def test_a_checked_line_round_trips_and_is_still_json(record: dict[str, object]) -> None:
    line = _line(record)
    assert unframe(line) == (record, True)
    assert json.loads(line)["r"] == record  # jq .r reads a log


@given(records, st.data())
def test_every_single_byte_change_is_caught(record: dict[str, object], data: st.DataObject) -> None:
    line = bytearray(_line(record))
    at = data.draw(st.integers(0, len(line) - 1))
    flip = data.draw(st.integers(1, 255))
    line[at] ^= flip
    try:
        got = unframe(bytes(line))
    except ValueError:  # BadFrame, or not JSON at all
        return
    # A change that still parses can only be one that leaves an unchecked line... never a
    # checked line with another record.
    assert got[1] is False or got[0] == record


def test_an_unchecked_line_is_read_as_before() -> None:
    assert unframe(b'{"t":"append","messages":[]}') == ({"t": "append", "messages": []}, False)
    with pytest.raises(BadFrame):
        unframe(b'{"c":"00000000","r":{"t":"x"}}')
    with pytest.raises(BadFrame):
        unframe(b'{"c":"zzzzzzzz","r":{"t":"x"}}')


def test_the_mark_number_is_rewritten_in_place_and_keeps_the_header_fields(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl.mark"
    write_mark(path, 3, {"user_id": "alice"})
    write_mark_number(path, 12)
    assert read_mark(path) == (12, {"user_id": "alice"})
    path.write_bytes(b"garb")
    assert read_mark(path) is None
    assert read_mark(tmp_path / "missing") is None
