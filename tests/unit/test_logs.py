"""Log lines (contextsvc/logs.py): one JSON object a line, and no password of a URL in them."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from contextsvc.logs import setup_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restored_logging")
def test_httpx_request_lines_show_a_urls_user_but_not_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    # A summarizer's base_url may carry credentials; httpx logs every request's URL at INFO.
    setup_logging("INFO")
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200))) as client:
        client.post("http://user:hunter2@127.0.0.1:56450/v1/chat/completions")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    events = [line["event"] for line in lines if line["logger"] == "httpx"]
    assert events == ['HTTP Request: POST http://user:***@127.0.0.1:56450/v1/chat/completions "HTTP/1.1 200 OK"']
