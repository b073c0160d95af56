"""Helpers for tests that drive real ``manage.py`` subprocesses and wait on state."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote

REPO_ROOT = Path(__file__).resolve().parent.parent
TMP_DIR = REPO_ROOT / ".tmp"
TMP_DIR.mkdir(exist_ok=True)

T = TypeVar("T")

# Every process start_manage() started and nobody has reaped yet; the `worker_env` fixture
# kills the leftovers before the test database is flushed or dropped.
_started: list[ManageProcess] = []


def database_url(settings_dict: Mapping[str, Any]) -> str:
    """A DATABASE_URL naming the database described by a connection's ``settings_dict``.

    During a test ``settings_dict["NAME"]`` already is the test database, so a subprocess
    given this URL works on the very database the test sees.
    """
    engine = settings_dict["ENGINE"]
    name = str(settings_dict["NAME"])
    if engine == "django.db.backends.sqlite3":
        path = Path(name)
        if not path.is_absolute() or name.startswith(("file:", ":memory:")):
            raise ValueError(
                f"worker subprocesses need an absolute SQLite file, not {name!r}; "
                "in-memory databases are private to one process"
            )
        return f"sqlite:///{path}"
    if engine == "django.db.backends.postgresql":
        user = quote(str(settings_dict.get("USER") or ""), safe="")
        password = quote(str(settings_dict.get("PASSWORD") or ""), safe="")
        auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
        host = settings_dict.get("HOST") or "localhost"
        port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
        return f"postgres://{auth}{host}{port}/{quote(name, safe='')}"
    raise ValueError(f"no DATABASE_URL form for engine {engine!r}")


def subprocess_env(settings_dict: Mapping[str, Any], **extra: str) -> dict[str, str]:
    """The environment for ``python -m django ...`` against the given database."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "DATABASE_URL": database_url(settings_dict),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": pythonpath,
        "PYTHONUNBUFFERED": "1",
        "AGENTRUNS_TEST_SUBPROCESS": "1",
        **extra,
    }


def manage_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "django", *args]


def run_manage(
    args: Sequence[str], env: Mapping[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m django <args>`` to completion; output captured as text."""
    return subprocess.run(
        manage_command(args),
        env=dict(env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class ManageProcess:
    """A running ``python -m django <args>``, its output kept in temporary files.

    Files, not pipes: a chatty worker would block on a full pipe nobody reads.
    Use as a context manager, or call :meth:`stop`; leftovers are killed by `worker_env`.
    """

    def __init__(self, args: Sequence[str], env: Mapping[str, str]) -> None:
        self.args = list(args)
        # Open for the process's lifetime; closed by close().
        self._stdout: IO[bytes] = tempfile.TemporaryFile(dir=TMP_DIR)  # noqa: SIM115
        self._stderr: IO[bytes] = tempfile.TemporaryFile(dir=TMP_DIR)  # noqa: SIM115
        self.popen = subprocess.Popen(
            manage_command(args),
            env=dict(env),
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._stdout,
            stderr=self._stderr,
            # Its own session: a signal the test sends reaches this process only.
            start_new_session=True,
        )
        _started.append(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float = 20) -> int:
        """Wait for exit; on timeout raise AssertionError showing the output so far."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A worker dumps its threads' stacks on SIGUSR1: show where it is stuck.
            self.send_signal(signal.SIGUSR1)
            with contextlib.suppress(AssertionError):
                wait_until(lambda: "most recent call first" in self.output(), timeout=5)
            raise AssertionError(
                f"{self.args} still running after {timeout}s\n{self.output()}"
            ) from None

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM, then wait for a clean exit (the graceful-stop path)."""
        if self.popen.poll() is None:
            self.terminate()
        return self.wait(timeout)

    def _read(self, f: IO[bytes]) -> str:
        """All the process wrote so far. `pread`, not seek and read: the process shares
        the file's offset, and a write of its own between a seek to 0 and the read would
        land at the start, over what it wrote before (a SIGUSR1 stack dump so written
        overwrote the log's first line and lost its own frames)."""
        fd = f.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    @property
    def stdout(self) -> str:
        return self._read(self._stdout)

    @property
    def stderr(self) -> str:
        return self._read(self._stderr)

    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}"

    def close(self) -> None:
        """Kill if still running, reap, and drop the output files."""
        if self.popen.poll() is None:
            self.kill()
        self.popen.wait()
        self._stdout.close()
        self._stderr.close()
        if self in _started:
            _started.remove(self)

    def __enter__(self) -> ManageProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_manage(args: Sequence[str], env: Mapping[str, str]) -> ManageProcess:
    """Start ``python -m django <args>`` in the background, e.g. a ``runworker``."""
    return ManageProcess(args, env)


def close_all_started() -> list[str]:
    """Kill and reap every process still open; return the args of those that were running."""
    running = [" ".join(p.args) for p in _started if p.returncode is None]
    for process in list(_started):
        process.close()
    return running


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 60,
    interval: float = 0.02,
    message: str | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Tests wait on state with this, never with bare sleeps. On timeout raise AssertionError
    naming what was awaited and the last value seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(interval)


def store_payloads(run_ids: Sequence[int], kind: str, value: Any) -> None:
    """Give these runs a newer `kind` payload (input, output): what `.update(input=...)`
    did while input and output were columns of the run row."""
    from django_agentruns.models import RunPayload

    RunPayload.objects.bulk_create(RunPayload(run_id=pk, kind=kind, value=value)
                                   for pk in run_ids)


def _plan_nodes(explained: Any) -> Iterator[dict[str, Any]]:
    """The nodes of an `EXPLAIN (ANALYZE, FORMAT JSON)` plan."""
    def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield plan
        for child in plan.get("Plans", ()):
            yield from nodes(child)

    yield from nodes((json.loads(explained) if isinstance(explained, str)
                      else explained)[0]["Plan"])


def plan_rows_read(explained: Any, table: str) -> int:
    """Rows the scans of `table` in an `EXPLAIN (ANALYZE, FORMAT JSON)` plan returned or
    filtered out, over all loops: what a statement read, whatever its time."""
    return sum((node["Actual Rows"] + node.get("Rows Removed by Filter", 0))
               * node["Actual Loops"] for node in _plan_nodes(explained)
               if node.get("Relation Name") == table)


def plan_rows_handled(explained: Any) -> int:
    """Rows every node of a plan returned or filtered out (joins' filters too), over all
    loops: a statement's work, whatever its time. A join that compares every pair of
    two inputs shows as their product."""
    return sum((node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
                + node.get("Rows Removed by Join Filter", 0)) * node["Actual Loops"]
               for node in _plan_nodes(explained))
