"""Browser fixtures: the system Chromium driven by Playwright (installed by scripts/test-browser.sh)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: run scripts/test-browser.sh (scripts/test.sh does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # Never a downloaded browser: the system one, headless, with a fresh profile per context.
        b = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    # The page's strict CSP (no eval) also blocks Playwright's string predicates in
    # wait_for_function; bypassing it affects only the test driver, not the page's own scripts.
    context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield pg
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
