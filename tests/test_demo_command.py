"""`make demo`'s command, as a new user runs it: against a fresh SQLite file, with the
example project's settings; it must end with every run finished, say so briefly, and
fail loudly when it could not finish."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, TMP_DIR

pytestmark = pytest.mark.slow


def demo(db: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{db}",
           "DJANGO_SETTINGS_MODULE": "example_project.settings"}
    env.pop("AGENTRUNS_TEST_SUBPROCESS", None)
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):  # the demo's canned model, not a real one
        env.pop(name, None)
    for command in (["migrate", "--verbosity", "0"], ["demo", *args]):
        done = subprocess.run([sys.executable, "manage.py", *command], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode or command[0] == "demo":
            return done
    raise AssertionError("unreachable")


def statuses(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT status, COUNT(*) FROM django_agentruns_agentrun "
                            "GROUP BY status").fetchall()
    return dict(rows)


def test_the_demo_finishes_every_run_and_says_what_next() -> None:
    with tempfile.TemporaryDirectory(dir=TMP_DIR) as tmp:
        db = Path(tmp) / "demo.sqlite3"
        done = demo(db)
        assert done.returncode == 0, done.stdout + done.stderr
        counts = statuses(db)
        assert set(counts) <= {"succeeded", "failed"}, counts
        assert counts == {"succeeded": 10, "failed": 1}  # the run that passes its budget
        with sqlite3.connect(db) as conn:
            # The Pydantic AI assistant's refund tool ran once, after its approval.
            tool_steps = conn.execute(
                "SELECT s.status FROM django_agentruns_runstep s JOIN django_agentruns_agentrun"
                " r ON r.id = s.run_id WHERE r.agent = 'demo.assistant' AND s.name LIKE "
                "'%.tool.refund.%'").fetchall()
            streamed = "".join(json.loads(payload)["text"] for (payload,) in conn.execute(
                "SELECT e.payload FROM django_agentruns_runevent e JOIN "
                "django_agentruns_agentrun r ON r.id = e.run_id WHERE r.agent = "
                "'demo.assistant' AND e.type = 'stream' ORDER BY e.seq"))
        assert tool_steps == [("done",)]
        assert streamed == ("I will ask for a refund of 20 EUR on order 1042."
                            "All set: refunded 20 EUR on order 1042. Anything else?")
    out = done.stdout
    lines = out.splitlines()
    assert len(lines) < 30, out
    assert done.stderr == ""
    assert "approving it as demo-operator" in out
    assert "claimed 0 runs" not in out
    assert "demo.refund" in out
    assert '"refunded": 60' in out
    assert "(demo.assistant, Pydantic AI) asks to call refund(" in out
    assert "model demo-model) answered: All set: refunded 20 EUR on order 1042." in out
    for step in ("createsuperuser", "runserver", "/admin/django_agentruns/agentrun/",
                 "/demo/live/"):
        assert step in out


def test_the_demo_fails_when_runs_are_left_unfinished() -> None:
    with tempfile.TemporaryDirectory(dir=TMP_DIR) as tmp:
        db = Path(tmp) / "demo.sqlite3"
        done = demo(db, "--timeout", "0")
        assert done.returncode != 0
        assert "11 runs left unfinished" in done.stderr
        assert "createsuperuser" not in done.stdout
        assert statuses(db) == {"queued": 11}
