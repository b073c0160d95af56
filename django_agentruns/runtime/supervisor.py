"""`runworker --processes N`: one command, N worker processes, each its own worker.

A worker process is bounded by one core (the GIL): its own Python and psycopg time per run
caps it whatever its `--concurrency`. The supervisor forks N children that share nothing
but the database (each has its own concurrency slots, its connections, its lease keeper,
its listener and its worker record) and keeps them running:

- a child that dies (SIGKILL, the OOM killer, a crash) is logged and forked again after a
  backoff that doubles per quick death, capped at `BACKOFF_MAX`; the runs it held are
  reclaimed by any worker once their leases lapse, as after any worker's death;
- SIGTERM or SIGINT is passed to every child, which stops as a lone worker does (the grace
  period, then interrupted and released); the supervisor waits for them, then leaves.
  A second signal is passed on too: the children leave at once.

Why not leave it to the process manager: systemd, supervisord or Kubernetes restart one
process; N of them there means N units or N containers to configure and scale together.
This is the prefork model of Celery or gunicorn, and a process manager still watches the
one supervisor. Children are forked (POSIX) after every database connection is closed, so
none shares a socket with the supervisor or another child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from ..db import close_all_connections

logger = logging.getLogger("django_agentruns.supervisor")

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
HEALTHY_AFTER = 30.0  # seconds a child must live for its next death to start over
STOP_MARGIN = 10.0  # seconds past the grace a child gets to stop before SIGKILL
TICK = 0.05


@dataclass
class Slot:
    """One of the N places a child process fills."""

    index: int
    pid: int = 0
    started: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    restart_at: float | None = 0.0  # None: done (a burst child that finished)


class Supervisor:
    """Forks `processes` children running `child(index)` and keeps them running.

    `child(index)` runs in the forked process and returns its exit code (an exception
    counts as a crash). In burst mode a child that exits 0 is done and not restarted;
    `run()` returns once all are done.
    """

    def __init__(self, processes: int, child: Callable[[int], int], *, grace: float,
                 burst: bool = False, backoff_start: float = BACKOFF_START,
                 backoff_max: float = BACKOFF_MAX) -> None:
        if processes < 1:
            raise ValueError(f"--processes must be at least 1, not {processes}")
        self.slots = [Slot(i) for i in range(processes)]
        self.child = child
        self.grace = grace
        self.burst = burst
        self.backoff_start = backoff_start
        self.backoff_max = backoff_max
        self.signals = 0
        self._kill_at: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        logger.info("supervisor %s: starting %d worker processes", os.getpid(),
                    len(self.slots))
        try:
            while not self._finished():
                self._reap()
                if self.signals:
                    self._escalate()
                else:
                    self._start_due()
                time.sleep(TICK)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        logger.info("supervisor %s: all worker processes stopped", os.getpid())
        return 0

    def _finished(self) -> bool:
        running = any(slot.pid for slot in self.slots)
        if self.signals:
            return not running
        return not running and all(slot.restart_at is None for slot in self.slots)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals == 1:
            self._kill_at = time.monotonic() + self.grace + STOP_MARGIN
            logger.info("supervisor: signal %s, stopping %d worker processes (grace %.1fs)",
                        signal.Signals(signum).name, self.live, self.grace)
        for slot in self.slots:  # a second signal, passed on, makes them leave at once
            if slot.pid:
                self._send(slot.pid, signal.SIGTERM)

    @property
    def live(self) -> int:
        return sum(1 for slot in self.slots if slot.pid)

    # ------------------------------------------------------------------ children

    def _start_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if not slot.pid and slot.restart_at is not None and now >= slot.restart_at:
                self._fork(slot)

    def _fork(self, slot: Slot) -> None:
        close_all_connections()  # no socket shared with a child
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the supervisor's loop
            code = 1
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)  # the worker installs its own
                code = self.child(slot.index)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        slot.pid, slot.started = pid, time.monotonic()
        logger.info("supervisor: worker process %d started (pid %d)", slot.index, pid)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is not None:
                self._exited(slot, os.waitstatus_to_exitcode(status))

    def _exited(self, slot: Slot, code: int) -> None:
        slot.pid = 0
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if self.signals:
            slot.restart_at = None
            logger.info("supervisor: worker process %d stopped (%s)", slot.index, how)
            return
        if self.burst and code == 0:
            slot.restart_at = None  # nothing left to do
            return
        lived = time.monotonic() - slot.started
        slot.quick_deaths = 1 if lived >= HEALTHY_AFTER else slot.quick_deaths + 1
        wait = min(self.backoff_max, self.backoff_start * 2 ** (slot.quick_deaths - 1))
        slot.restarts += 1
        slot.restart_at = time.monotonic() + wait
        logger.warning("supervisor: worker process %d died (%s) after %.1fs; restarting it "
                       "in %.1fs (restart %d); its runs are reclaimed as their leases lapse",
                       slot.index, how, lived, wait, slot.restarts)

    def _escalate(self) -> None:
        """Past the grace (and a margin), a child still running is killed."""
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            for slot in self.slots:
                if slot.pid:
                    logger.warning("supervisor: worker process %d (pid %d) did not stop "
                                   "in time; killing it", slot.index, slot.pid)
                    self._send(slot.pid, signal.SIGKILL)
            self._kill_at = None

    @staticmethod
    def _send(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
