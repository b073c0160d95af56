"""The worker process: claims due runs, runs them, keeps their leases, stops gracefully.

Threads: the main loop claims and dispatches; each attempt runs in a pool thread (an
async agent's coroutine runs on one shared event loop, its pool thread waiting on it);
one settle thread writes the successes (group_commit); one lease keeper renews every live
lease in one statement per TTL/3 and turns cancel requests, lost leases and timeouts into
stops; on PostgreSQL one thread LISTENs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from . import execution, metrics, reaper, tracing, transitions, usage, visibility
from .conf import app_settings
from .context import AttemptControl, StopReason
from .exceptions import AgentRunsError, UnknownAgentError
from .group_commit import GroupCommit
from .models import AgentRun
from .notify import Listener
from .registry import AgentSpec, all_agents, check_worker_names, find_agent, scope_policy
from .transitions import AttemptRef, Renewal

logger = logging.getLogger("django_agentruns.worker")

CONTENTION_START = 0.002
CONTENTION_MAX = 0.1
LAPSED_SCAN_INTERVAL = 1.0


class ContentionTimeout(AgentRunsError):
    """A burst worker waited too long on runs held by another worker."""


def make_worker_id() -> str:
    """Unique per process start, so a restarted worker never matches its old fence."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class WorkerStats:
    claimed: int = 0
    settled: dict[str, int] = field(default_factory=dict)
    pass_errors: int = 0
    reaped: int = 0


@dataclass
class _Live:
    run: AgentRun
    spec: AgentSpec | None
    control: AttemptControl
    last_renewed: float


class Worker:
    def __init__(
        self,
        queues: Sequence[str] | None = None,
        concurrency: int = 1,
        *,
        burst: bool = False,
        worker_id: str | None = None,
        poll_interval: float | None = None,
        grace: float | None = None,
        reap_interval: float | None = None,
        max_contention_wait: float = 300.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.queues = list(queues or [app_settings.DEFAULT_QUEUE])
        self.concurrency = concurrency
        self.burst = burst
        self.worker_id = worker_id or make_worker_id()
        check_worker_names(self.queues, self.worker_id)
        self.poll_interval = float(poll_interval if poll_interval is not None
                                   else app_settings.POLL_INTERVAL)
        self.grace = float(grace if grace is not None else app_settings.GRACE)
        self.reap_interval = float(reap_interval if reap_interval is not None
                                   else app_settings.REAP_INTERVAL)
        self.max_contention_wait = max_contention_wait
        self.stats = WorkerStats()
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._live: dict[int, _Live] = {}
        self._live_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agentrun")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()
        self._listener_stop = threading.Event()
        self._listener: Listener | None = None
        self._signals = 0
        self._last_reap = 0.0
        self._last_lapsed_scan = 0.0
        self._limits_read = float("-inf")
        self._limits_in_use = False
        self._agents = all_agents()
        # Claims take only runs of these: another worker's agent (a rolling deploy's new
        # one) is left queued for a worker that has it, not dead-lettered here.
        self._known = frozenset(self._agents)
        self._scopes = scope_policy(self._agents)
        self._ttls = {name: s.effective_lease_ttl() for name, s in self._agents.items()}
        # Successes that finish together are written in one transaction, on one connection.
        self.successes = GroupCommit(
            lambda items: transitions.settle_succeeded_many(self.worker_id, items),
            on_error=_close_connections)

    # ----------------------------------------------------------------- lifecycle

    def run(self, install_signals: bool = True) -> WorkerStats:
        """Serve until stopped (or, in burst mode, until nothing is due)."""
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        logger.info("worker %s serving queues %s with concurrency %s%s", self.worker_id,
                    ",".join(self.queues), self.concurrency, " (burst)" if self.burst else "",
                    extra={"worker_id": self.worker_id})
        self._keeper = threading.Thread(target=self._keep_leases, name="agentruns-keeper",
                                         daemon=True)
        self._keeper.start()
        if Listener.available():
            self._listener = Listener(self.queues, self._wake, self._listener_stop,
                                      worker_id=self.worker_id,
                                      poll_interval=self.poll_interval)
            self._listener.start()
        try:
            self._serve()
        finally:
            self._shutdown()
        return self.stats

    def stop(self) -> None:
        """Ask the worker to stop: no new claims, running attempts get the grace period."""
        self.stopping.set()
        self._wake.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            # A second signal: leave now. Leases lapse and the runs are reclaimed.
            logger.warning("second signal: exiting at once", extra={"worker_id": self.worker_id})
            os._exit(1)
        logger.info("signal %s: stopping (grace %.1fs)", signal.Signals(signum).name,
                    self.grace, extra={"worker_id": self.worker_id})
        self.stop()

    @property
    def busy(self) -> int:
        with self._live_lock:
            return len(self._live)

    # ----------------------------------------------------------------- main loop

    def _serve(self) -> None:
        errors = 0
        contention_wait = CONTENTION_START
        contention_since: float | None = None
        while not self.stopping.is_set():
            self._wake.clear()
            try:
                close_old_connections()
                self._maybe_reap()
                claimed = self._claim()
                errors = 0
            except Exception:
                # The worker survives its database: log, back off, try again.
                errors += 1
                self.stats.pass_errors += 1
                wait = min(30.0, 0.1 * 2 ** min(errors, 9))
                logger.exception("worker pass failed (%s in a row); retrying in %.1fs", errors,
                                 wait, extra={"worker_id": self.worker_id})
                _close_connections()
                self.stopping.wait(wait)
                continue
            if claimed:
                contention_wait, contention_since = CONTENTION_START, None
                continue  # claim again at once if slots remain
            if self.burst and self.busy == 0:
                if not self._work_pending():
                    return
                # Contention is not idleness: another worker holds what is due.
                now = time.monotonic()
                contention_since = contention_since or now
                if now - contention_since > self.max_contention_wait:
                    raise ContentionTimeout(
                        f"runs stayed due but unclaimable for {self.max_contention_wait}s")
                self.stopping.wait(contention_wait)
                contention_wait = min(CONTENTION_MAX, contention_wait * 2)
                continue
            self._wake.wait(self.poll_interval if self.busy < self.concurrency else None)

    def _claim(self) -> int:
        free = self.concurrency - self.busy
        if free <= 0:
            return 0
        # Lapsed leases are looked for at most once a second: one statement less per claim.
        now = time.monotonic()
        include_lapsed = now - self._last_lapsed_scan >= LAPSED_SCAN_INTERVAL
        batch = min(free, int(app_settings.CLAIM_BATCH))
        limited = self._claim_limited(batch, now)  # flow control: limited keys' runs first
        runs = limited + transitions.claim(
            self.worker_id, self.queues, batch - len(limited), self._scopes,
            self._ttls, float(app_settings.LEASE_TTL), include_lapsed=include_lapsed,
            agents=self._known)
        if include_lapsed and len(limited) < batch:  # else the claim did not look
            self._last_lapsed_scan = now
        for run in runs:
            self._start(run)
        self.stats.claimed += len(runs)
        return len(runs)

    def _claim_limited(self, batch: int, now: float) -> list[AgentRun]:
        """Runs of keys with a limits row (flow control, transitions.limited). Whether any
        key has one is read at most once a second: until then a new row only delays its
        key's runs (the ordinary claim skips them in its own statement), never lets one
        past its limit."""
        if now - self._limits_read >= LAPSED_SCAN_INTERVAL:
            if self._limits_read == float("-inf"):
                transitions.seed_settings_limits()  # the LIMITS setting's keys get rows
            self._limits_in_use = transitions.limits_in_use()
            self._limits_read = now
        if not self._limits_in_use:
            return []
        return transitions.claim_limited(
            self.worker_id, self.queues, batch, self._scopes, self._ttls,
            float(app_settings.LEASE_TTL), agents=self._known)

    def _work_pending(self) -> bool:
        # Not every queued, due run: one behind a dead letter or a backoff is not waiting
        # on another worker, nor one of an agent this worker lacks (a worker that has it
        # takes it); waiting for those would end in ContentionTimeout.
        at = timezone.now()
        if transitions.awaited(self.queues, at, self._scopes, self._known).exists():
            return True
        left = visibility.due_elsewhere(self.queues, self._known, at)
        if left:
            logger.warning("leaving %s due runs of agents this worker does not have (%s): "
                           "a worker that has them will claim them", sum(left.values()),
                           ", ".join(sorted({agent for _, agent in left})),
                           extra={"worker_id": self.worker_id})
        return False

    def _maybe_reap(self) -> None:
        if self.reap_interval <= 0:
            return
        now = time.monotonic()
        if now - self._last_reap < self.reap_interval:
            return
        self._last_reap = now
        report = reaper.reap()
        self.stats.reaped += report.total

    # ----------------------------------------------------------------- attempts

    def _start(self, run: AgentRun) -> None:
        spec = self._agents.get(run.agent) or find_agent(run.agent)
        ttl = spec.effective_lease_ttl() if spec else float(app_settings.LEASE_TTL)
        ref = AttemptRef(run.pk, run.attempt, self.worker_id, ttl, agent=run.agent)
        control = AttemptControl(ref, spec.timeout if spec else None, run.checkpoint_count)
        usage.arm(control, run, spec)  # flow control: the run's budget and totals
        live = _Live(run, spec, control, time.monotonic())
        with self._live_lock:
            self._live[run.pk] = live
        logger.info("run %s %s attempt %s started", run.pk, run.agent, run.attempt,
                    extra=_extra(ref, run.agent))
        if spec is not None and spec.is_async:
            self._ensure_loop()
        future = self._pool.submit(self._attempt, live)
        future.add_done_callback(functools.partial(self._attempt_done, live))

    def _attempt(self, live: _Live) -> None:
        run, control = live.run, live.control
        began = time.monotonic()
        try:
            close_old_connections()
            # Current while the agent runs, so the agent's own spans nest in the attempt's.
            with tracing.attempt_span(run, self.worker_id) as span:
                outcome = self._outcome(live)
                # The agent may have left this thread's connection broken (the database
                # restarted mid-run): replace it before the outcome is written.
                close_old_connections()
                settlement = self._record(live, outcome)
                span.set_outcome(settlement.value, outcome.error or outcome.stop_reason)
            execution.log_settlement(control.ref, run.agent, settlement, outcome)
            self.stats.settled[settlement.value] = self.stats.settled.get(settlement.value, 0) + 1
            metrics.observe_settlement(run.agent, settlement.value, metrics.queue_wait(run),
                                       time.monotonic() - began)
        except BaseException:
            # Storage failed while settling: the run stays running until its lease lapses,
            # then the reaper (or a claim) takes it back. Nothing is lost. BaseException:
            # in a pool thread nothing else would ever read it.
            logger.exception("run %s: could not record the attempt's outcome", run.pk,
                             extra=_extra(control.ref, run.agent))
        finally:
            control.done.set()
            with self._live_lock:
                if self._live.get(run.pk) is live:
                    del self._live[run.pk]
            close_old_connections()
            self._wake.set()

    def _attempt_done(self, live: _Live, future: Future[None]) -> None:
        """Log what escaped `_attempt` (nothing should): a pool future is never read."""
        error = None if future.cancelled() else future.exception()
        if error is not None:
            logger.error("run %s: attempt thread raised", live.run.pk, exc_info=error,
                         extra=_extra(live.control.ref, live.run.agent))

    def _record(self, live: _Live, outcome: execution.Outcome) -> transitions.Settlement:
        """Write the outcome, retrying a database error for up to half the lease.

        Each settle is one guarded transaction, so a retry after a commit whose answer was
        lost finds the guard unmatched and writes nothing twice. Past half the lease the
        run is left to lapse and be reclaimed, as if this worker had died.
        """
        deadline = time.monotonic() + (live.control.ref.lease_ttl or 0.0) / 2
        wait = 0.05
        while True:
            try:
                return execution.record(live.spec, live.control.ref, outcome,
                                        succeed=self.successes.settle)
            except DatabaseError as exc:
                if time.monotonic() + wait > deadline:
                    raise
                logger.warning("run %s: recording the outcome failed (%s); retrying in %.2fs",
                               live.run.pk, exc, wait,
                               extra=_extra(live.control.ref, live.run.agent))
                connection.close()
                time.sleep(wait)
                wait = min(1.0, wait * 2)

    def _outcome(self, live: _Live) -> execution.Outcome:
        if live.spec is None:
            return execution.Outcome(
                "failed", error=UnknownAgentError(live.run.agent, list(self._agents)))
        ctx = execution.make_context(live.run, live.control)
        return execution.call_agent(live.spec, ctx, live.control, self._loop)

    def _ensure_loop(self) -> None:
        if self._loop is not None:
            return
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="agentruns-loop", daemon=True)
        thread.start()
        self._loop, self._loop_thread = loop, thread

    # ----------------------------------------------------------------- lease keeper

    def _keep_leases(self) -> None:
        while not self._keeper_stop.is_set():
            with self._live_lock:
                lives = list(self._live.values())
            try:
                self._keeper_tick(lives)
            except Exception:
                logger.exception("lease keeper failed; retrying",
                                 extra={"worker_id": self.worker_id})
                _close_connections()
            ttls = [lv.control.ref.lease_ttl for lv in lives if lv.control.ref.lease_ttl]
            # Wake often enough to renew at a third of the shortest TTL, and to notice
            # timeouts promptly.
            self._keeper_stop.wait(min([*ttls, 3.0]) / 6)
        _close_connections()

    def _keeper_tick(self, lives: list[_Live]) -> None:
        now = time.monotonic()
        due: list[_Live] = []
        for lv in lives:
            control, ttl = lv.control, lv.control.ref.lease_ttl or 0.0
            if control.timed_out():
                control.request_stop(StopReason.TIMEOUT)
                if control.deadline is not None and now > control.deadline + ttl / 3:
                    # Stuck past its timeout in code that never reaches a step boundary:
                    # stop renewing, so the lease lapses and the run is reclaimed.
                    continue
            if ttl and now - lv.last_renewed >= ttl / 3:
                due.append(lv)
        if not due:
            return
        close_old_connections()
        results = transitions.renew_many(self.worker_id, [lv.control.ref for lv in due])
        for lv in due:
            renewal = results.get(lv.control.ref, Renewal.LOST)
            if renewal is Renewal.LOST:
                lv.control.request_stop(StopReason.LEASE_LOST)
                continue
            lv.last_renewed = now
            if renewal is Renewal.CANCEL_REQUESTED:
                lv.control.request_stop(StopReason.CANCELLED)

    # ----------------------------------------------------------------- graceful stop

    def _shutdown(self) -> None:
        """No new claims; attempts get the grace period; then they are abandoned."""
        deadline = time.monotonic() + self.grace
        while self.busy and time.monotonic() < deadline:
            self._wake.wait(0.05)
            self._wake.clear()
        with self._live_lock:
            remaining = list(self._live.values())
        for lv in remaining:
            lv.control.request_stop(StopReason.SHUTDOWN)
        # Stopped attempts record themselves as abandoned once their storage call (if
        # any) returns; give them a moment, then record the stuck ones ourselves.
        settle_by = time.monotonic() + 2.0
        for lv in remaining:
            lv.control.done.wait(max(0.0, settle_by - time.monotonic()))
        for lv in remaining:
            if not lv.control.done.is_set():
                try:
                    # Flow control: a graceful stop interrupts (no budget spent).
                    settlement = transitions.interrupt(lv.control.ref, "the worker stopped")
                    logger.info("run %s %s attempt %s %s (the worker stopped; agent stuck)",
                                lv.run.pk, lv.run.agent, lv.control.ref.attempt,
                                settlement.value, extra=_extra(lv.control.ref, lv.run.agent))
                except Exception:
                    logger.exception("could not abandon run %s", lv.run.pk)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.successes.close()
        self._keeper_stop.set()
        self._listener_stop.set()
        # Their connections must be closed when run() returns (a test database cannot be
        # dropped while a session is open on it).
        threads = [self._keeper, self._listener.thread if self._listener else None]
        for thread in threads:
            if thread is not None:
                thread.join(timeout=5)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        logger.info("worker %s stopped", self.worker_id, extra={"worker_id": self.worker_id})

    @property
    def stuck_attempts(self) -> int:
        """Attempts whose thread is still inside agent code after the worker stopped."""
        return self.busy


def _extra(ref: AttemptRef, agent: str) -> dict[str, Any]:
    return {"run_id": ref.run_id, "agent": agent, "attempt": ref.attempt,
            "worker_id": ref.worker_id}


def _close_connections() -> None:
    from django.db import connections

    for conn in connections.all(initialized_only=True):
        with contextlib.suppress(Exception):
            conn.close()
