"""``Retry-After`` as the HTTP summarizers read it (RFC 9110 §10.2.3: delay-seconds or an HTTP date)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from contextsvc.summarizers._http import retry_after

NOW = datetime(2026, 12, 7, 20, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("7", 7.0),
        (" 120 ", 120.0),
        ("0", 0.0),
        ("Mon, 07 Dec 2026 20:00:30 GMT", 30.0),
        ("Mon, 07 Dec 2026 19:59:00 GMT", 0.0),  # already past: no pause asked
        ("", 0.0),
        ("soon", 0.0),
        ("-5", 0.0),
        ("1.5", 0.0),  # not delay-seconds (an integer) nor a date
        ("²", 0.0),  # a digit to str.isdigit, not to float()
        ("٣", 0.0),
    ],
)
def test_retry_after_is_delay_seconds_or_a_date(header: str, seconds: float) -> None:
    assert retry_after(header, now=NOW) == seconds
