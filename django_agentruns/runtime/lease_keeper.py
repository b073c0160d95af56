"""The lease keeper: one thread per worker that keeps every live attempt's lease.

It renews all the leases due in one statement (`renew_many`) at a third of each TTL, and
turns what storage answers into stops: a cancel request, a lost lease. It also enforces
timeouts: an attempt past its deadline is told to stop, and one stuck past it (in code
that never reaches a step boundary) is no longer renewed, so its lease lapses and the
run is reclaimed. It has its own connection, and writes nothing but leases.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.db import close_old_connections

from .. import transitions
from ..db import close_all_connections
from ..outcomes import Renewal, StopReason
from . import steps
from .running import Live, LiveAttempts

logger = logging.getLogger("django_agentruns.worker")


class LeaseKeeper:
    """`on_tick` runs after every pass (the worker's presence beat, which paces itself)."""

    def __init__(self, worker_id: str, live: LiveAttempts,
                 on_tick: Callable[[], None] | None = None) -> None:
        self.worker_id = worker_id
        self.live = live
        self.on_tick = on_tick
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._next_pass = float("inf")  # monotonic time the keeper will next look
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agentruns-keeper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop renewing, and wait for the thread (its connection closed) for `timeout`."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            lives = self.live.snapshot()
            try:
                self.tick(lives)
            except Exception:
                logger.exception("lease keeper failed; retrying",
                                 extra={"worker_id": self.worker_id})
                close_all_connections()
            if self.on_tick is not None:
                self.on_tick()
            # Wake often enough to renew at a third of the shortest TTL, and to notice
            # timeouts promptly.
            interval = self.interval(lives)
            self._next_pass = time.monotonic() + interval
            self._wake.wait(interval)
            self._wake.clear()  # before the next snapshot: a later start wakes it again
        close_all_connections()

    def started(self, live: Live) -> None:
        """A new attempt whose lease falls due before the keeper's next pass (a short TTL
        after an idle spell, a slow claim) wakes it, so its first renewal is on time too."""
        ttl = live.control.ref.lease_ttl
        if ttl and live.last_renewed + ttl / 3 < self._next_pass:
            self._wake.set()

    @staticmethod
    def interval(lives: list[Live]) -> float:
        ttls = [lv.control.ref.lease_ttl for lv in lives if lv.control.ref.lease_ttl]
        return min([*ttls, 3.0]) / 6

    def tick(self, lives: list[Live], now: float | None = None) -> None:
        """One pass: stops for timeouts, then one renewal of every lease a third spent."""
        now = time.monotonic() if now is None else now
        due: list[Live] = []
        for lv in lives:
            control, ttl = lv.control, lv.control.ref.lease_ttl or 0.0
            steps.flush_held(control, now)  # a long step's start, held until now
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
