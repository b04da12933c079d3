"""``api.mapping.timestamp``: a datetime on the wire exactly as protobuf's own ``FromDatetime`` puts it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf import timestamp_pb2

from contextsvc.api.mapping import timestamp


@pytest.mark.parametrize(
    "value",
    [
        datetime(2026, 12, 2, 10, 33, 7, 123456, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 500000, tzinfo=UTC),  # before the epoch: nanos stay positive
        datetime(2026, 1, 1, 3, tzinfo=timezone(timedelta(hours=5, minutes=30))),  # another offset
        datetime(2026, 6, 1, 12, 0, 0, 1),  # naive: taken as UTC
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
def test_the_timestamp_is_the_one_protobuf_makes(value: datetime) -> None:
    expected = timestamp_pb2.Timestamp()
    expected.FromDatetime(value)
    assert timestamp(value) == expected
    assert timestamp(value).ToDatetime(tzinfo=UTC) == (value if value.tzinfo else value.replace(tzinfo=UTC))


def test_no_time_is_no_timestamp() -> None:
    assert timestamp(None) is None
