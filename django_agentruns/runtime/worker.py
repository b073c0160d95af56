"""The worker process: the claim loop, burst and contention handling, the stop sequence.

The roles it starts have their own modules: each claimed attempt runs through the
`executor`, a sync agent in a pool thread, an async one as a coroutine on one shared
event loop; every write of every attempt goes through the attempt `store`, whose
`WRITER_CONNECTIONS` writers commit them together; the `lease_keeper` renews every live
lease in one statement per TTL/3 and turns cancel requests, lost leases and timeouts into
stops; the `live` set is what they share; on PostgreSQL one thread LISTENs (`notify`).
So a worker's connections are bounded whatever its concurrency (`connections()`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

from django.db import close_old_connections, connection

from .. import transitions
from ..conf import app_settings
from ..db import close_all_connections
from ..models import AgentRun
from ..outcomes import AttemptRef, Settlement, StopReason
from ..payloads import load_inputs
from ..queries import load_states
from ..queues import PausedSet
from ..registry import AgentSpec, all_agents, check_worker_names, find_agent, scope_policy
from ..streaming.transport import drain_sender
from ..transitions.fair import FairClaim
from ..transitions.limited import LimitedClaim
from ..transitions.plans import plan_by_index
from . import usage
from .attempt_store import AttemptStore
from .chores import LATE, Chores
from .executor import Executor, extra
from .handover import Handed, Handover
from .late import Deferred
from .lease_keeper import LeaseKeeper
from .presence import Presence
from .running import Live, LiveAttempts, Starting, attempt_done, spawn
from .stop_signals import StopSignals
from .ticker import Ticker
from .wakeups import Listener
from .worker_outcome import ContentionTimeout, WorkerStats, make_worker_id, work_pending

logger = logging.getLogger("django_agentruns.worker")

CONTENTION_START = 0.002
CONTENTION_MAX = 0.1
LAPSED_SCAN_INTERVAL = 1.0


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
        self.live = LiveAttempts()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agentrun")
        self.presence = Presence(self)  # the worker's record, for operators (workers.py)
        # One beat per keeper pass at most every min(5 s, LEASE_TTL/3) (Presence paces it).
        self.keeper = LeaseKeeper(self.worker_id, self.live, on_tick=self.presence.tick)
        self._listener_stop = threading.Event()
        self._listener: Listener | None = None
        self._last_lapsed_scan = 0.0
        self._limited = LimitedClaim(LAPSED_SCAN_INTERVAL)  # flow control
        self._fair = FairClaim(LAPSED_SCAN_INTERVAL)  # fair shares, once a group exists
        self._agents = all_agents()
        # Claims take only runs of these: another worker's agent (a rolling deploy's new
        # one) is left queued for a worker that has it, not dead-lettered here.
        self._known = frozenset(self._agents)
        self._scopes = scope_policy(self._agents)
        self._ttls = {name: s.effective_lease_ttl() for name, s in self._agents.items()}
        # Every write of every attempt, committed together on WRITER_CONNECTIONS
        # connections: started with the worker (`run`), closed when it stops.
        self.store: AttemptStore | None = None
        self.handover: Handover | None = None
        self.executor = Executor(self.worker_id, known=self._agents)
        # Paused queues are left out of claims; this worker takes part in ticking schedules
        self._paused = PausedSet()
        self._ticker = Ticker(self._agents, self.queues)
        # The loop's work besides claiming, and the views its claims use, kept fresh.
        self.chores = Chores(self.worker_id, self.reap_interval, self._reaped, self._ticker,
                             (self._paused.read_if_due, self._fair.on, self._limited.in_use))

    @staticmethod
    def connections() -> int:
        """The most connections this worker opens, whatever its concurrency: the store's
        writers, the claim loop, the lease keeper, the listener (PostgreSQL), and the live
        chunk sender (`chunk_transport.Sender`, only while its agents stream: closed
        `IDLE_CLOSE` s after the last chunk).

        Agent code's own ORM queries are the agent's, on top (see docs/deployment.md)."""
        return int(app_settings.WRITER_CONNECTIONS) + 3 + (1 if Listener.available() else 0)

    # ----------------------------------------------------------------- lifecycle

    def run(self, install_signals: bool = True) -> WorkerStats:
        """Serve until stopped (or, in burst mode, until nothing is due)."""
        if install_signals and threading.current_thread() is threading.main_thread():
            StopSignals(self.stop, self.grace, self.worker_id).install()
        logger.info("worker %s serving queues %s with concurrency %s%s", self.worker_id,
                    ",".join(self.queues), self.concurrency, " (burst)" if self.burst else "",
                    extra={"worker_id": self.worker_id})
        self.store = self.executor.store = AttemptStore()
        # On PostgreSQL a success is settled by the claim loop, with its next claim.
        self.handover = self.executor.settles = Handover(
            self.store, self._wake, open=connection.vendor == "postgresql")
        self._limited.seed()  # the LIMITS setting's keys get their rows
        self.presence.start()
        self.keeper.start()
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

    @property
    def agent_names(self) -> list[str]:
        return list(self._agents)

    @property
    def busy(self) -> int:
        return len(self.live)

    # ----------------------------------------------------------------- main loop

    def _serve(self) -> None:
        errors = 0
        contention_wait = CONTENTION_START
        contention_since: float | None = None
        # A woken pass claims first, on its views as they are; the loop's other work
        # (`chores`, the lapsed-lease scan) waits for a pass that starts no run, not straight
        # after one that did (its Python work would hold the GIL the new attempt's thread
        # needs). Fresh passes do it first: the first, after an idle wait timed out, a
        # catch-up, a late one. docs/performance.md, "Start latency".
        fresh_next, started = True, False
        while not self.stopping.is_set():
            fresh = fresh_next or self.chores.late() or self._lapsed_due(LATE)
            fresh_next = False
            self._wake.clear()
            try:
                close_old_connections()
                plan_by_index()  # once per server connection (transitions.plans)
                if fresh:
                    self.chores.tick()
                claimed = self._claim(fresh)
                if not (fresh or claimed or started):
                    fresh_next = bool(self.chores.tick()) or self._lapsed_due()
                started = bool(claimed)
                errors = 0
            except Exception:
                # The worker survives its database: log, back off, try again.
                errors += 1
                self.stats.pass_errors += 1
                wait = min(30.0, 0.1 * 2 ** min(errors, 9))
                logger.exception("worker pass failed (%s in a row); retrying in %.1fs", errors,
                                 wait, extra={"worker_id": self.worker_id})
                close_all_connections()
                self.stopping.wait(wait)
                fresh_next = True
                continue
            if claimed or fresh_next:
                contention_wait, contention_since = CONTENTION_START, None
                if self.busy < self.concurrency:
                    continue  # claim again at once if slots remain (or duties left some)
            elif self.burst and self.busy == 0:
                if not work_pending(self.queues, self._scopes, self._known, self.worker_id):
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
            # Wake for the next schedule tick too
            tick = self._ticker.seconds_to_next()
            idle = self.poll_interval if tick is None else min(self.poll_interval, tick)
            fresh_next = not self._wake.wait(idle if self.busy < self.concurrency else tick)
            started = False  # its attempts had the wait to start

    def _lapsed_due(self, after: float = LAPSED_SCAN_INTERVAL) -> bool:
        """Lapsed leases are looked for at most once a second: one statement less per claim."""
        return time.monotonic() - self._last_lapsed_scan >= after

    def _claim(self, fresh: bool = True) -> int:
        """Settle the successes handed over and claim; `fresh=False`: the claim trusts its
        views as they are and skips the lapsed-lease scan (see `_serve`)."""
        assert self.handover is not None
        taken = self.handover.take()  # successes: settled with this claim
        try:
            return self._settle_and_claim(taken, fresh)
        finally:
            self.handover.release()

    def _settle_and_claim(self, taken: list[Handed], fresh: bool) -> int:
        assert self.handover is not None
        # The slots of the successes settled here are free once the statement has run.
        free = self.concurrency - self.busy + len(taken)
        queues = self._paused.active(self.queues, fresh=fresh)
        if not taken and (free <= 0 or not queues):
            return 0
        now = time.monotonic()
        include_lapsed = fresh and self._lapsed_due()
        batch = min(free, int(app_settings.CLAIM_BATCH)) if queues else 0
        fair = self._fair.on(fresh=fresh)
        try:
            # Flow control: runs of keys with a limits row first, never past their limit.
            limited = self._limited.claim(self.worker_id, queues, batch, self._scopes,
                                          self._ttls, float(app_settings.LEASE_TTL),
                                          self._known, fair, fresh=fresh)
            settled, claimed = transitions.settle_and_claim(
                self.worker_id, [(h.write.ref, h.write.output) for h in taken], queues,
                batch - len(limited), self._scopes, self._ttls, float(app_settings.LEASE_TTL),
                include_lapsed=include_lapsed, agents=self._known, fair=fair)
        except BaseException:
            self.handover.to_store(taken)  # not written: the store writes them
            raise
        runs = limited + claimed
        self.handover.release()  # successes from now on wait for the next pass
        with suppress(Exception):  # states, inputs the claim did not return: a read each
            load_states(runs)
            load_inputs(runs)
        if include_lapsed and len(limited) < batch:  # else the claim did not look
            self._last_lapsed_scan = now
        try:
            self._start_all(runs, leased_at=now)
            for handed in taken:
                # Its end wakes nobody if a run took its slot, or if it ends on this
                # thread (`then`): this loop looks at the slot next, as the claim did.
                live = self.live.get(handed.write.ref.run_id)
                # That attempt's, not a later one of the same run just started.
                if live is not None and live.run.attempt == handed.write.ref.attempt and (
                        len(runs) >= len(taken) or handed.then is not None):
                    live.refilled = True
        finally:  # committed: their attempts wait for the answer, whatever happened since
            self.handover.settled(taken, settled)
        self.stats.claimed += len(runs)
        return len(runs)

    def _reaped(self, count: int) -> None:
        self.stats.reaped += count

    # ----------------------------------------------------------------- attempts

    def _start_all(self, runs: Sequence[AgentRun], leased_at: float) -> None:
        """Start the claimed runs: sync agents' each on a thread, async agents' coroutines
        on the executor's loop, handed over together (`running.spawn`). `leased_at`: the
        monotonic time before the claim, whose leases count from then, not from now."""
        started: list[Starting] = []
        try:
            for run in runs:
                if (attempt := self._start(run, leased_at)) is not None:
                    started.append(attempt)
        finally:
            if started:
                self.executor.ensure_loop().call_soon_threadsafe(spawn, started,
                                                                 attempt_done)

    def _start(self, run: AgentRun, leased_at: float) -> Starting | None:
        """Set up an attempt of `run`: a sync agent's starts; an async agent's is returned."""
        spec = self._agents.get(run.agent) or find_agent(run.agent)
        # The lease the claim just gave it (no setting read per run).
        ttl = self._ttls.get(run.agent) or \
            (spec.effective_lease_ttl() if spec else float(app_settings.LEASE_TTL))
        ref = AttemptRef(run.pk, run.attempt, self.worker_id, ttl, agent=run.agent)
        control = self.executor.control(ref, spec.timeout if spec else None,
                                        run.checkpoint_count)
        usage.arm(control, run, spec)  # flow control: the run's budget and totals
        live = Live(run, spec, control, leased_at)
        self.live.add(live)
        self.keeper.started(live)
        logger.info("run %s %s attempt %s started", run.pk, run.agent, run.attempt,
                    extra=extra(ref, run.agent))
        if spec is not None and spec.is_async:
            # A coroutine on the executor's loop: no thread, no connection of its own.
            return live, self._aattempt(live, spec)
        future = self._pool.submit(self._attempt, live)
        future.add_done_callback(functools.partial(attempt_done, live))
        return None

    def _attempt(self, live: Live) -> None:
        result: Settlement | Deferred | None = None
        end = functools.partial(self._end, live)
        try:
            result = self.executor.run(live.run, live.spec, live.control, end)
        finally:
            # The agent's own queries may have opened this thread's connection: it is not
            # kept to the next attempt (a pooled one goes back to Django's pool).
            close_all_connections()
            self._end(live, result)

    async def _aattempt(self, live: Live, spec: AgentSpec) -> None:
        result: Settlement | Deferred | None = None
        end = functools.partial(self._end, live)
        try:
            result = await self.executor.arun(live.run, spec, live.control, end)
        finally:
            self._end(live, result)

    def _end(self, live: Live, result: Settlement | Deferred | None) -> None:
        """An attempt counted and its slot freed; for a success handed off (`runtime.late`)
        not yet: whoever settles it calls this then, on its own thread."""
        if isinstance(result, Deferred):
            return
        if result is not None:
            self.stats.settled[result.value] = self.stats.settled.get(result.value, 0) + 1
        live.control.done.set()
        self.live.discard(live)
        if not live.refilled:
            self._wake.set()

    # ----------------------------------------------------------------- graceful stop

    def _shutdown(self) -> None:
        """No new claims; attempts get the grace period; then they are stopped and recorded
        as interrupted (requeued without spending their budget)."""
        if self.handover is not None:
            self.handover.close()  # successes from now on go to the store
        deadline = time.monotonic() + self.grace
        while self.busy and time.monotonic() < deadline:
            self._wake.wait(0.05)
            self._wake.clear()
        remaining = self.live.snapshot()
        for lv in remaining:
            lv.control.request_stop(StopReason.SHUTDOWN)
        # Stopped attempts record themselves once their write returns; stuck ones we do
        settle_by = time.monotonic() + 2.0
        for lv in remaining:
            lv.control.done.wait(max(0.0, settle_by - time.monotonic()))
        for lv in remaining:
            if not lv.control.done.is_set():
                try:
                    # A graceful stop interrupts (no budget spent), as the attempt would.
                    settlement = transitions.interrupt(lv.control.ref, "the worker stopped")
                    logger.info("run %s %s attempt %s %s (the worker stopped; agent stuck)",
                                lv.run.pk, lv.run.agent, lv.control.ref.attempt,
                                settlement.value, extra=extra(lv.control.ref, lv.run.agent))
                except Exception:
                    logger.exception("could not interrupt run %s", lv.run.pk)
        self._pool.shutdown(wait=False, cancel_futures=True)
        drain_sender()  # the stored text's chunk rows go now, not after the process exits
        if self.store is not None:
            self.store.close()
        self._listener_stop.set()
        # Their connections closed when run() returns (else a test database stays in use)
        self.keeper.stop(timeout=5)
        if self._listener is not None:
            self._listener.thread.join(timeout=5)
        self.presence.stop()
        self.executor.close()
        logger.info("worker %s stopped", self.worker_id, extra={"worker_id": self.worker_id})

    @property
    def stuck_attempts(self) -> int:
        """Attempts whose thread is still inside agent code after the worker stopped."""
        return self.busy
