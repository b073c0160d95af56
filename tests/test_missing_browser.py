"""A missing browser is said as loudly as a missing PostgreSQL: a banner in pytest's
summary when the browser tests skip, and a failure when CI or REQUIRE_BROWSER asks for
them. Checked by running one browser test in a pytest of its own, chromium pointed away."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import helpers

# The inner pytest runs on its own SQLite file whichever pass runs this one, so one pass
# (SQLite's) is enough.
pytestmark = [pytest.mark.slow, pytest.mark.sqlite_only]

ONE_BROWSER_TEST = "tests/test_console_browser.py"


def run_pytest(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CI", "REQUIRE_BROWSER", "AGENTRUNS_BROWSER_MARKER")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ONE_BROWSER_TEST,
         "-x", "--maxfail=1", "-k", "not overview"],
        cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**clean, "AGENTRUNS_CHROMIUM": "/nonexistent/chromium",
             "DATABASE_URL": f"sqlite:///{helpers.TMP_DIR}/missing-browser.sqlite3", **env})


def test_missing_chromium_skips_the_browser_tests_with_a_banner() -> None:
    done = run_pytest()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROWSER TESTS SKIPPED" in done.stdout
    assert "/nonexistent/chromium is missing" in done.stdout
    assert "REQUIRE_BROWSER=1" in done.stdout


def test_missing_chromium_fails_when_browsers_are_required() -> None:
    done = run_pytest(REQUIRE_BROWSER="1")
    assert done.returncode != 0, done.stdout
    assert " error" in done.stdout or " failed" in done.stdout, done.stdout
    assert "browser tests must run" in done.stdout
