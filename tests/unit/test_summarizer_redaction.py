"""A credential a summarizer endpoint echoes back is never shown, not even the part a cut leaves."""

from __future__ import annotations

import httpx
import pytest

from contextsvc.summarizers._http import HttpEndpoint

KEY = "sk-proj-" + "A1b2C3d4" * 8


def endpoint() -> HttpEndpoint:
    return HttpEndpoint(
        who="openai summarizer (test)",
        client=httpx.AsyncClient(),
        url="http://127.0.0.1:9/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout_seconds=1,
        connect_timeout_seconds=1,
        total_timeout_seconds=1,
        max_retries=0,
        backoff_seconds=0,
        max_answer_bytes=1 << 20,
    )


@pytest.mark.parametrize("lead", [0, 200, 230, 240])
def test_a_key_echoed_where_the_snippet_is_cut_shows_none_of_it(lead: int) -> None:
    # The snippet keeps 300 characters; leads 200-240 put the key across the cut. A key cut before
    # it was redacted was shown in part, which the redaction of the whole message missed.
    body = '{"error": {"message": "' + "x" * lead + f' Incorrect API key provided: {KEY}"}}}}'
    shown = endpoint().shown(body)
    assert KEY[:12] not in shown
