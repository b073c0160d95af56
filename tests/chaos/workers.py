"""The chaos harness's worker processes: start them, retire the dead, and the faults dealt
to them (SIGKILL, SIGSTOP/SIGCONT, SIGTERM and its clean exit).

A base class of `tests.chaos.harness.Chaos`, which holds the state named below and runs the
chaos loop that calls these at random times.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time

from django_agentruns.models import AgentRun, Status
from tests import helpers
from tests.chaos.plan import ChaosConfig, ChaosReport
from tests.chaos.support import _pids, _thaw, guarded
from tests.testapp.chaos_agents import CHAOS_SLOW


class ChaosWorkers:
    """The worker processes of one chaos run and the signals they get."""

    config: ChaosConfig
    env: dict[str, str]
    rng: random.Random
    report: ChaosReport
    workers: list[helpers.ManageProcess]
    frozen: dict[helpers.ManageProcess, threading.Timer]
    stopping: list[helpers.ManageProcess]
    logs: list[str]
    spared: dict[int, float]

    def _start_worker(self, concurrency: int | None = None, grace: float | None = None
                      ) -> helpers.ManageProcess:
        args = ["runworker", "--concurrency", str(concurrency or self.config.concurrency),
                "--grace", str(self.config.grace if grace is None else grace)]
        worker = helpers.start_manage(args, self.env)
        self.workers.append(worker)
        self.report.workers_started += 1
        return worker

    def _retire(self, worker: helpers.ManageProcess) -> None:
        """Reap a dead worker process and keep its output for the log checks."""
        worker.popen.wait()
        self.logs.append(worker.stderr)
        worker.close()
        if worker in self.workers:
            self.workers.remove(worker)
        self.frozen.pop(worker, None)

    def _killable(self) -> list[helpers.ManageProcess]:
        return [w for w in self.workers if w not in self.stopping and w.returncode is None]

    def _spare_slow(self) -> None:
        now = time.monotonic()
        owners = AgentRun.objects.filter(agent=CHAOS_SLOW, attempt=1,
                                         status=Status.RUNNING).values_list("claimed_by",
                                                                            flat=True)
        for pid in _pids(owners):
            self.spared[pid] = now + 3.0
        for pid, until in list(self.spared.items()):
            if until < now:
                del self.spared[pid]

    def _kill_one(self) -> None:
        candidates = [w for w in self._killable() if w.pid not in self.spared]
        if candidates:
            victim = self.rng.choice(candidates)
            victim.kill()
            self._retire(victim)
            self.report.kills += 1
        # Died by themselves? Replace them too; a crashed worker is a finding.
        for worker in [w for w in self.workers if w.returncode is not None
                       and w not in self.stopping]:
            self.report.problems.append(f"a worker exited {worker.returncode} on its own:\n"
                                        f"{worker.stderr[-3000:]}")
            self._retire(worker)
        while len(self._killable()) < self.config.workers:
            self._start_worker()

    def _freeze_one(self) -> None:
        """SIGSTOP a busy worker for longer than a lease: its runs are taken over meanwhile,
        and when it thaws its attempts carry on as if nothing happened, until a write of
        theirs meets the fence (or the lease keeper finds the lease lost)."""
        busy = guarded(self._busy_pids, set())
        candidates = [w for w in self._killable()
                      if not (w in self.frozen and self.frozen[w].is_alive())]
        candidates = [w for w in candidates if w.pid in busy] or candidates
        if not candidates:
            return
        victim = self.rng.choice(candidates)
        victim.send_signal(signal.SIGSTOP)
        timer = threading.Timer(self.config.lease_ttl * 1.5, _thaw, args=(victim,))
        timer.daemon = True
        timer.start()
        self.frozen[victim] = timer
        self.report.freezes += 1

    def _thaw_all(self) -> None:
        for worker, timer in list(self.frozen.items()):
            timer.cancel()
            _thaw(worker)
        self.frozen.clear()

    def _busy_pids(self) -> set[int]:
        return _pids(AgentRun.objects.filter(status=Status.RUNNING
                                             ).values_list("claimed_by", flat=True))

    def _sigterm_busy(self) -> bool:
        """SIGTERM one worker that holds runs right now; it must stop cleanly (exit 0)."""
        busy = guarded(self._busy_pids, set())
        candidates = [w for w in self._killable() if w.pid in busy
                      and not (w in self.frozen and self.frozen[w].is_alive())]
        if not candidates:
            return False
        victim = self.rng.choice(candidates)
        victim.terminate()
        self.stopping.append(victim)
        self.report.sigterms += 1
        self._start_worker()
        return True

    def _collect_stopped(self, timeout: float | None = None) -> None:
        """Workers that were SIGTERMed must exit 0 within their grace and a margin."""
        for worker in list(self.stopping):
            if timeout is not None:
                try:
                    worker.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    worker.kill()
            if worker.returncode is None:
                continue
            self.report.harness_checks += 1
            if worker.returncode != 0:
                self.report.problems.append(
                    f"a SIGTERMed worker exited {worker.returncode}:\n{worker.stderr[-3000:]}")
            self.stopping.remove(worker)
            self._retire(worker)
