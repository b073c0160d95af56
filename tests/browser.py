"""What the browser tests share: Playwright driving Debian's /usr/bin/chromium.

Test modules take `BROWSER_MARKS` as their `pytestmark` and use the `browser` fixture
(module scope) and `new_page(browser, width, height)`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import helpers

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:  # the skip below says what to install
    sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
# Artifacts of every run; `AGENTRUNS_SCREENSHOTS=docs/screenshots` refreshes the docs' ones.
SCREENSHOTS = helpers.REPO_ROOT / os.environ.get("AGENTRUNS_SCREENSHOTS", "artifacts/screenshots")
ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

# In CI (CI=true) a missing browser is a failure, not a skip: .ci/run installs it.
MAY_SKIP = not os.environ.get("CI")

BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(MAY_SKIP and sync_playwright is None, reason="playwright is not importable: "
                       "pip install playwright (never `playwright install`)"),
    pytest.mark.skipif(MAY_SKIP and not CHROMIUM.exists(),
                       reason=f"{CHROMIUM} is missing: apt-get install -y chromium"),
]


def launched_browser() -> Iterator[Browser]:
    """Chromium for one test module, with the ORM allowed beside Playwright's event loop.

    Playwright's sync API keeps an event loop on this thread, and Django's ORM would take the
    test's own queries (and pytest-django's flush) for async code; the switch is undone after.
    """
    before = os.environ.get(ASYNC_UNSAFE)
    os.environ[ASYNC_UNSAFE] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                                 args=CHROMIUM_ARGS)
            yield browser
            browser.close()
    finally:
        if before is None:
            del os.environ[ASYNC_UNSAFE]
        else:
            os.environ[ASYNC_UNSAFE] = before


def new_page(browser: Browser, width: int, height: int) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(10_000)
    yield context.new_page()
    context.close()


def screenshot(page: Page, name: str, **options: Any) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=str(path), **options)
    return path
