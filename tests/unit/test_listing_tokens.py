"""ListSessions page tokens: a position in the listing with the offset it stood for; forged ones refused."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from contextsvc.core.session import MAX_EPOCH_MICROS, ListPosition
from contextsvc.engine import paging
from contextsvc.errors import InvalidArgument

FILTER = ("sessions", "coder", "needle")
SID = "6f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f"


def forged(body: dict[str, Any], *filter_parts: str) -> str:
    """A token made by hand: they are not signed, so a client can write any (the filter hash too)."""
    raw = json.dumps({**body, "f": paging._filter_hash(*filter_parts)}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_a_position_token_round_trips_with_its_offset() -> None:
    position = ListPosition(True, 1_764_000_000_123_456, SID)
    token = paging.encode_listing_token(position, 40, *FILTER)
    assert paging.decode_listing_token(token, *FILTER) == (position, 40)
    # A replica still on offset tokens reads the offset of the same page.
    assert paging.decode_page_token(token, *FILTER) == 40
    assert paging.decode_listing_token("", *FILTER) == (None, 0)


def test_an_offset_token_of_an_older_server_is_read_as_an_offset() -> None:
    assert paging.decode_listing_token(forged({"o": 25}, *FILTER), *FILTER) == (None, 25)


@pytest.mark.parametrize(
    "key",
    [
        [False, MAX_EPOCH_MICROS + 1, SID],  # past what a datetime holds: it overflowed into INTERNAL
        [False, 10**20, SID],
        [False, -1, SID],
        [False, 5, "\udc80"],  # no session id has this form: PostgreSQL failed on it
        [False, 5, "a\x00"],
        [False, 5, SID.upper()],
        [1, 5, SID],
        [False, True, SID],
        [False, 5],
        "k",
    ],
)
def test_a_forged_position_is_invalid_argument_naming_the_field(key: Any) -> None:
    with pytest.raises(InvalidArgument) as caught:
        paging.decode_listing_token(forged({"k": key, "o": 3}, *FILTER), *FILTER)
    assert caught.value.violations[0].field == "page_token"


def test_a_token_of_another_filter_is_refused() -> None:
    token = paging.encode_listing_token(ListPosition(False, 5, SID), 1, *FILTER)
    with pytest.raises(InvalidArgument):
        paging.decode_listing_token(token, "sessions", "coder", "other")
