"""Show the chaos summary lines in pytest's output, captured or not (CI runs without -s)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import SUMMARIES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SUMMARIES:
        terminalreporter.section("chaos")
        for line in SUMMARIES:
            terminalreporter.write_line(line)
