"""The inspector page in a real browser (system Chromium via Playwright) against real processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from contextsvc._gen.v1 import context_service_pb2 as pb
from contextsvc._gen.v1 import resources_pb2 as r
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub
from tests.support.gateway import Process, bundled_gateway
from tests.support.rpc import assistant, tool, user

pytestmark = pytest.mark.e2e

UNKNOWN = "00000000-0000-4000-8000-000000000000"
TIMEOUT_MS = 30_000  # generous: CI machines may be shared and slow


@pytest.fixture(scope="module")
def bundled() -> Iterator[Process]:
    with bundled_gateway() as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(bundled: Process) -> Iterator[ContextServiceStub]:
    with grpc.insecure_channel(bundled.grpc_address) as channel:
        yield ContextServiceStub(channel)


def busy_session(stub: Any, name: str, turns: int = 8) -> str:
    sid = str(stub.CreateSession(pb.CreateSessionRequest(name=name)).id)
    pinned = r.Message(role=r.ROLE_USER, content="Always answer in French.", flags=r.MessageFlags(is_pinned=True))
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[pinned]))
    for n in range(turns):
        stub.AppendMessages(
            pb.AppendMessagesRequest(
                session_id=sid,
                messages=[
                    user(f"question {n} about the harbour{n} " + "words " * 250),
                    assistant("", calls=[(f"c{n}", "lookup")]),
                    tool(f"c{n}", f"result {n} " + "data " * 300),
                    assistant(f"answer {n}"),
                ],
                turn_complete=True,
            )
        )
    return sid


def meter_total(page: Any) -> int:
    return int(page.get_attribute("#meter", "data-total"))


def test_session_page_sends_a_message_and_compacts(page: Any, bundled: Process, stub: Any) -> None:
    sid = busy_session(stub, "harbour")
    page.goto(f"{bundled.http_url}/sessions/{sid}")
    page.wait_for_selector("#display .row", timeout=TIMEOUT_MS)
    assert page.text_content("#session-name") == "harbour"
    page.wait_for_function("Number(document.querySelector('#meter').dataset.total) > 0", timeout=TIMEOUT_MS)
    # Pinned and tool rows are marked; the context has no summary yet.
    assert page.locator("#context .row .tag.pinned").count() >= 1
    assert page.locator("#context .row.summary").count() == 0

    page.fill("#message-input", "What about the lighthouse?")
    page.click("#composer button[type=submit]")
    page.wait_for_selector('#events li[data-type="messages_appended"]', timeout=TIMEOUT_MS)
    page.wait_for_selector("#display .row:has-text('What about the lighthouse?')", timeout=TIMEOUT_MS)
    before = meter_total(page)

    page.click("#compress-button")
    page.wait_for_selector("#preview:not([hidden])", timeout=TIMEOUT_MS)
    preview = page.text_content("#preview-body")
    # The dry run names how the run compresses: the busy session's tool results are cleared first.
    assert "By clearing old tool results: would clear" in preview or "By a summary" in preview, preview
    page.click("#compress-confirm")
    page.wait_for_selector('#events li[data-type="context_compressed"]', timeout=TIMEOUT_MS)
    page.wait_for_selector("#context .row.summary", timeout=TIMEOUT_MS)
    page.wait_for_function(f"Number(document.querySelector('#meter').dataset.total) < {before}", timeout=TIMEOUT_MS)
    assert meter_total(page) < before * 0.9
    # Rows compressed out of the context stay in the display history, marked.
    assert page.locator("#display .row.demoted").count() > 0

    # ExpandSummary on the summary row shows the originals; SearchHistory finds dropped text.
    page.click("#context .row.summary .expand")
    page.wait_for_selector("#context .row.summary .expanded .row", timeout=TIMEOUT_MS)
    assert "question 0" in page.text_content("#context .row.summary .expanded")
    page.fill("#history-query", "harbour1")
    page.click("#search-form button[type=submit]")
    page.wait_for_selector("#search-results li pre", timeout=TIMEOUT_MS)
    assert "harbour1" in page.text_content("#search-results")


def shown_sequences(page: Any, column: str) -> list[int]:
    return [
        int(seq)
        for seq in page.eval_on_selector_all(f"#{column} > .row", "rows => rows.map(r => r.dataset.seq)")
        if seq and seq.isdigit()
    ]


def test_load_older_pages_both_buffers_back_to_the_first_message(page: Any, bundled: Process, stub: Any) -> None:
    """The view frame carries the newest 500 rows of each buffer; "Load older" pages back with the
    API's page_token until the first message, and a live refresh keeps what was paged in."""
    total = 1050
    sid = str(stub.CreateSession(pb.CreateSessionRequest(name="long")).id)
    rows = [user(f"row {n}") if n % 2 else assistant(f"row {n}") for n in range(1, total + 1)]
    for start in range(0, total, 500):
        stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=rows[start : start + 500]))
    page.goto(f"{bundled.http_url}/sessions/{sid}")
    page.wait_for_selector("#display .row", timeout=TIMEOUT_MS)
    for column in ("display", "context"):
        assert shown_sequences(page, column) == list(range(total - 499, total + 1))
        assert page.locator(f"#{column}-older").count() == 1
    assert page.text_content("#display-count") == "(500+)"

    for column in ("display", "context"):
        for shown in (1000, total):
            page.click(f"#{column}-older")
            page.wait_for_function(
                f"document.querySelectorAll('#{column} > .row[data-seq]').length >= {shown}", timeout=TIMEOUT_MS
            )
        assert shown_sequences(page, column) == list(range(1, total + 1))
        assert page.locator(f"#{column}-older").count() == 0
        assert "row 1" in page.text_content(f"#{column} > .row[data-seq='1']")
    assert page.text_content("#display-count") == f"({total})"

    # A live message refreshes the view (the newest 500): the older rows stay, the new one joins.
    stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("one more")]))
    page.wait_for_selector(f"#display > .row[data-seq='{total + 1}']", timeout=TIMEOUT_MS)
    page.wait_for_selector(f"#context > .row[data-seq='{total + 1}']", timeout=TIMEOUT_MS)
    for column in ("display", "context"):
        assert shown_sequences(page, column) == list(range(1, total + 2))


def test_phone_size_has_no_sideways_scroll(page: Any, bundled: Process, stub: Any) -> None:
    sid = busy_session(stub, "phone", turns=3)
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{bundled.http_url}/sessions/{sid}")
    page.wait_for_selector("#context .row", timeout=TIMEOUT_MS)
    assert page.evaluate("document.documentElement.scrollWidth") <= 391
    # Columns stack: the context column sits below the display column.
    display_box = page.locator("#display").bounding_box()
    context_box = page.locator("#context").bounding_box()
    assert context_box["y"] > display_box["y"] + display_box["height"] - 1


def test_sessions_list_pinned_first_and_search(page: Any, bundled: Process, stub: Any) -> None:
    a = stub.CreateSession(pb.CreateSessionRequest(name="zz-plain-otter")).id
    b = stub.CreateSession(pb.CreateSessionRequest(name="zz-pinned-otter")).id
    stub.UpdateSession(
        pb.UpdateSessionRequest(
            session=r.Session(id=b, pinned=True), update_mask=field_mask_pb2.FieldMask(paths=["pinned"])
        )
    )
    page.goto(f"{bundled.http_url}/")
    page.fill("#session-search", "otter")
    page.wait_for_function("document.querySelectorAll('#sessions li').length === 2", timeout=TIMEOUT_MS)
    ids = page.eval_on_selector_all("#sessions li", "items => items.map(i => i.dataset.id)")
    assert ids == [b, a]
    page.click(f"#sessions li[data-id='{a}'] a")
    page.wait_for_url(f"**/sessions/{a}", timeout=TIMEOUT_MS)
    page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)


def test_unknown_session_closes_4004(page: Any, bundled: Process) -> None:
    page.goto(f"{bundled.http_url}/sessions/{UNKNOWN}")
    page.wait_for_function("document.body.dataset.closeCode === '4004'", timeout=TIMEOUT_MS)
    assert page.text_content("#session-name") == "Session not found"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_reconnect_after_the_gateway_drops_replays_exactly_the_missed_events(page: Any, tmp_path: Path) -> None:
    service = Process(["serve", "--listen", "127.0.0.1:0", "--store", f"files:{tmp_path / 'data'}"]).start()
    port = free_port()
    gateway_args = ["gateway", "--listen", f"127.0.0.1:{port}", "--target", service.grpc_address]
    gateway = Process(gateway_args).start()
    try:
        with grpc.insecure_channel(service.grpc_address) as channel:
            stub = ContextServiceStub(channel)
            sid = str(stub.CreateSession(pb.CreateSessionRequest(name="reconnect")).id)
            page.goto(f"{gateway.http_url}/sessions/{sid}")
            page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("seen live")]))
            page.wait_for_selector('#events li[data-type="messages_appended"]', timeout=TIMEOUT_MS)
            seen = page.evaluate("window.inspector.lastEventId")

            gateway.kill()  # the server side drops the socket
            page.wait_for_selector("#status[data-state=closed]", timeout=TIMEOUT_MS)
            missed = [
                stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user(f"missed {n}")]))
                for n in range(2)
            ]
            gateway = Process(gateway_args).start()

            page.wait_for_selector('#events li[data-type="replay_end"]', timeout=TIMEOUT_MS)
            replayed = page.eval_on_selector_all(
                "#events li.replayed", "items => items.map(i => [i.dataset.type, Number(i.dataset.eventId)])"
            )
            assert len(replayed) == 2 and all(kind == "messages_appended" and eid > seen for kind, eid in replayed)
            assert "2 missed events" in page.text_content('#events li[data-type="replay_start"]')
            assert [m.sequence_numbers[0] for m in missed] == [2, 3]
            # Then live again, with no duplicate.
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[user("live again")]))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                ids = page.eval_on_selector_all(
                    '#events li[data-type="messages_appended"]', "items => items.map(i => Number(i.dataset.eventId))"
                )
                if len(ids) >= 4:
                    break
                time.sleep(0.1)
            assert len(ids) == 4 and len(set(ids)) == 4
    finally:
        gateway.kill()
        service.kill()


def test_wrong_token_closes_4003_and_a_good_one_goes_live(browser: Any, tmp_path: Path) -> None:
    store = f"files:{tmp_path / 'data'}"
    token = subprocess.run(
        [sys.executable, "-m", "contextsvc", "tokens", "create", "--user", "carol", "--store", store],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()[-1]
    proc = Process(
        ["serve", "--listen", "127.0.0.1:0", "--store", store, "--auth", "tokens", "--gateway", "127.0.0.1:0"]
    ).start()
    try:
        with grpc.insecure_channel(proc.grpc_address) as channel:
            stub = ContextServiceStub(channel)
            sid = stub.CreateSession(
                pb.CreateSessionRequest(name="carol's"), metadata=(("authorization", f"Bearer {token}"),)
            ).id
        host = proc.gateway_address.rsplit(":", 1)[0]
        for cookie, outcome in (("wrong-token", "4003"), (token, "live")):
            context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True)
            context.add_cookies([{"name": "contextsvc_token", "value": cookie, "domain": host, "path": "/"}])
            page = context.new_page()
            page.goto(f"{proc.http_url}/sessions/{sid}")
            if outcome == "4003":
                page.wait_for_function("document.body.dataset.closeCode === '4003'", timeout=TIMEOUT_MS)
                assert "access denied" in page.text_content("#status")
            else:
                page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)
                assert page.text_content("#session-name") == "carol's"
            context.close()
    finally:
        proc.kill()


def test_inspector_over_https_and_wss_with_a_tls_server(browser: Any, tmp_path: Path) -> None:
    """serve --tls-cert … --gateway: the page over https, its socket over wss, the bundled gateway
    calling its own TLS server; a message sent from the page comes back as a live event."""
    from tests.support.certs import self_signed

    cert, key = self_signed("inspector", dns=("localhost",), ips=("127.0.0.1",)).write(tmp_path, "server")
    proc = Process(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store",
            "memory",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--gateway",
            "127.0.0.1:0",
        ]
    ).start()
    context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True, ignore_https_errors=True)
    try:
        assert proc.http_url.startswith("https://")
        credentials = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(proc.grpc_address, credentials) as channel:
            sid = ContextServiceStub(channel).CreateSession(pb.CreateSessionRequest(name="over https")).id
        page = context.new_page()
        page.goto(f"{proc.http_url}/sessions/{sid}")
        page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)
        assert page.text_content("#session-name") == "over https"
        assert page.evaluate("location.protocol") == "https:"
        page.fill("#message-input", "sent over wss")
        page.click("#composer button[type=submit]")
        page.wait_for_selector('#events li[data-type="messages_appended"]', timeout=TIMEOUT_MS)
        page.wait_for_selector("#display .row:has-text('sent over wss')", timeout=TIMEOUT_MS)
        # A token given on an https page is kept in a Secure cookie: cookies are not scoped by
        # scheme, and it would also go to a plain-http page of the same host.
        page.once("dialog", lambda dialog: dialog.accept("tok-over-https"))
        page.click("#token-button")
        page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)
        [cookie] = [c for c in context.cookies() if c["name"] == "contextsvc_token"]
        assert cookie["value"] == "tok-over-https" and cookie["secure"] is True
    finally:
        context.close()
        proc.kill()
