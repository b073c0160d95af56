"""The attempts a worker has running: shared by its claim loop, executor threads, lease
keeper and stop sequence, each of which only ever sees a consistent snapshot."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..models import AgentRun
from ..registry import AgentSpec
from .executor import AttemptControl, extra

logger = logging.getLogger("django_agentruns.worker")


@dataclass
class Live:
    """One running attempt: the run as claimed, its agent (None if unknown), its control,
    and when its lease was last renewed (monotonic seconds; the keeper's to update)."""

    run: AgentRun
    spec: AgentSpec | None
    control: AttemptControl
    last_renewed: float
    refilled: bool = False
    """Its success was settled by the claim loop, with a claim that took a run for its
    slot or ending on the loop's thread: its end need not wake the claim loop."""


class LiveAttempts:
    """A thread-safe set of running attempts, keyed by run id."""

    def __init__(self) -> None:
        self._by_run: dict[int, Live] = {}
        self._lock = threading.Lock()

    def add(self, live: Live) -> None:
        with self._lock:
            self._by_run[live.run.pk] = live

    def discard(self, live: Live) -> None:
        """Forget `live`, unless its run's entry is already another attempt's."""
        with self._lock:
            if self._by_run.get(live.run.pk) is live:
                del self._by_run[live.run.pk]

    def get(self, run_id: int) -> Live | None:
        with self._lock:
            return self._by_run.get(run_id)

    def snapshot(self) -> list[Live]:
        with self._lock:
            return list(self._by_run.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_run)


Starting = tuple[Live, Coroutine[Any, Any, None]]
"""An async attempt set up, and its coroutine, not yet on the executor's loop."""


def spawn(started: Sequence[Starting],
          done: Callable[[Live, asyncio.Future[None]], None]) -> None:
    """On the executor's loop: a task for each attempt's coroutine, `done(live, task)` at
    its end. The claim loop hands a whole claim's attempts over in one call (one wake-up
    of the loop), where each run's hand-over cost a wake-up and a thread-safe future."""
    loop = asyncio.get_running_loop()
    for live, coroutine in started:
        loop.create_task(coroutine).add_done_callback(functools.partial(done, live))


def attempt_done(live: Live, future: Future[None] | asyncio.Future[None]) -> None:
    """Log what escaped an attempt (nothing should): its thread's future or its task is
    never read otherwise."""
    if error := None if future.cancelled() else future.exception():
        logger.error("run %s: attempt thread raised", live.run.pk, exc_info=error,
                     extra=extra(live.control.ref, live.run.agent))
