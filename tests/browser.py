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
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError:  # the skip below says what to install
    sync_playwright = None

# AGENTRUNS_CHROMIUM: another binary (tests of what happens when it is missing use it).
CHROMIUM = Path(os.environ.get("AGENTRUNS_CHROMIUM", "/usr/bin/chromium"))
# Artifacts of every run; `AGENTRUNS_SCREENSHOTS=docs/screenshots` refreshes the docs' ones.
SCREENSHOTS = helpers.REPO_ROOT / os.environ.get("AGENTRUNS_SCREENSHOTS", "artifacts/screenshots")
ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

# A missing browser or Playwright skips these tests loudly (a banner in pytest's summary,
# and a line in scripts/test.sh's last words); with CI or REQUIRE_BROWSER set they fail
# instead: .ci/run installs Debian's chromium, and the test extra has playwright.
REQUIRED = bool(os.environ.get("CI") or os.environ.get("REQUIRE_BROWSER"))
MISSING_TAG = "BROWSER TESTS NOT RUN"
INSTALL_PLAYWRIGHT = "pip install playwright (the test extra has it; never `playwright install`)"
INSTALL_CHROMIUM = f"apt-get install -y chromium (for {CHROMIUM})"


def missing() -> str | None:
    """What is missing for the browser tests, or None."""
    if sync_playwright is None:
        return f"playwright is not importable: {INSTALL_PLAYWRIGHT}"
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: {INSTALL_CHROMIUM}"
    return None


def require_browser() -> None:
    """Skip (loudly) or fail, as REQUIRED says, when the browser cannot run."""
    what = missing()
    if what is None:
        return
    message = f"{MISSING_TAG}: {what}"
    if REQUIRED:
        pytest.fail(f"{message} (CI / REQUIRE_BROWSER is set: browser tests must run)",
                    pytrace=False)
    pytest.skip(message)


BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.usefixtures("browser_available"),  # conftest.py
]


def launched_browser() -> Iterator[Browser]:
    """Chromium for one test module, with the ORM allowed beside Playwright's event loop.

    Playwright's sync API keeps an event loop on this thread, and Django's ORM would take the
    test's own queries (and pytest-django's flush) for async code; the switch is undone after.
    """
    require_browser()
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
    # Generous: a check passes as soon as the page agrees, so a long timeout only lengthens a
    # failure, and a machine loaded by a second test pass needs it.
    context.set_default_timeout(30_000)
    expect.set_options(timeout=30_000)
    yield context.new_page()
    context.close()


def screenshot(page: Page, name: str, **options: Any) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=str(path), **options)
    return path
