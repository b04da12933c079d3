"""Regenerate docs/inspector.png: a demo session in a bundled server, shot at 1280x800 by the system
Chromium through Playwright (scripts/test-browser.sh installs both).

    python3 scripts/inspector_screenshot.py [OUT.png]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from contextsvc._gen.v1 import context_service_pb2 as pb  # noqa: E402
from contextsvc._gen.v1 import resources_pb2 as r  # noqa: E402
from contextsvc._gen.v1.context_service_pb2_grpc import ContextServiceStub  # noqa: E402
from tests.support.gateway import Process  # noqa: E402
from tests.support.rpc import assistant, tool, user  # noqa: E402

TOPICS = ["the harbour tides", "ferry timetables", "the lighthouse keeper", "winter storms", "fish markets"]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "inspector.png"
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium is not installed: run scripts/test-browser.sh")
    server = Process(["serve", "--listen", "127.0.0.1:0", "--store", "memory", "--gateway", "127.0.0.1:0"]).start()
    try:
        with grpc.insecure_channel(server.grpc_address) as channel:
            stub = ContextServiceStub(channel)
            sid = stub.CreateSession(pb.CreateSessionRequest(name="harbour research")).id
            pin = r.Message(role=r.ROLE_USER, content="Always cite the source.", flags=r.MessageFlags(is_pinned=True))
            stub.AppendMessages(pb.AppendMessagesRequest(session_id=sid, messages=[pin]))
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(f"{server.http_url}/sessions/{sid}")
                page.wait_for_selector("#status[data-state=live]")
                for n, topic in enumerate(TOPICS * 2):
                    stub.AppendMessages(
                        pb.AppendMessagesRequest(
                            session_id=sid,
                            messages=[
                                user(f"Tell me about {topic}. " + "Give details and numbers. " * 40),
                                assistant("", calls=[(f"call{n}", "web_search")]),
                                tool(f"call{n}", f"Search results for {topic}: " + "a long page of text. " * 120),
                                assistant(f"Here is what I found about {topic}. " + "It varies by season. " * 10),
                            ],
                            turn_complete=True,
                        )
                    )
                page.click("#compress-button")
                page.wait_for_selector("#preview:not([hidden])")
                page.click("#compress-confirm")
                page.wait_for_selector("#context .row.summary")
                page.fill("#message-input", "And the tides next week?")
                page.click("#composer button[type=submit]")
                page.wait_for_selector("#display .row:has-text('And the tides next week?')")
                page.wait_for_timeout(500)
                page.screenshot(path=str(out))
                browser.close()
    finally:
        server.kill()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
