"""Paused queues: workers claim nothing from one until it is resumed.

A pause is a row of `PausedQueue`. The claim's statement carries `NOT EXISTS` against that
(small) table, so no claim that starts after `pause_queue` returns takes a run of the
queue; and each worker keeps the list of paused queues, read at most once a second
(`PausedSet`), to leave them out of its claims altogether, so a paused queue's backlog is
not even scanned. Attempts already running finish normally; lapsed runs of a paused queue
are requeued by the reaper and wait for the resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from django.db import IntegrityError, transaction

from .exceptions import InvalidInputError
from .models import PausedQueue
from .registry import QUEUE_RULE, is_queue_name
from .validation import storable_text

logger = logging.getLogger("django_agentruns.queues")

REFRESH_INTERVAL = 1.0


def pause_queue(name: str, *, by: str = "") -> bool:
    """Stop workers claiming from queue `name`; False if it was paused already."""
    _check(name)
    try:
        with transaction.atomic():
            PausedQueue.objects.create(name=name, paused_by=storable_text(str(by)[:255]))
    except IntegrityError:
        return False
    logger.info("queue %s paused%s", name, f" by {by}" if by else "")
    return True


def resume_queue(name: str, *, by: str = "") -> bool:
    """Let workers claim from queue `name` again; False if it was not paused."""
    _check(name)
    deleted, _ = PausedQueue.objects.filter(name=name).delete()
    if deleted:
        logger.info("queue %s resumed%s", name, f" by {by}" if by else "")
    return bool(deleted)


def paused_queues() -> dict[str, PausedQueue]:
    """Every paused queue, by name."""
    return {p.name: p for p in PausedQueue.objects.all()}


def _check(name: str) -> None:
    if not is_queue_name(name):
        raise InvalidInputError(f"a queue name is {QUEUE_RULE}, not {name!r:.120}")


class PausedSet:
    """A worker's view of the paused queues, read at most once per `REFRESH_INTERVAL`.

    Only an optimisation: the claim statement itself refuses paused queues.
    """

    def __init__(self, refresh: float = REFRESH_INTERVAL) -> None:
        self.refresh = refresh
        self._names: frozenset[str] = frozenset()
        self._read_at = float("-inf")

    def active(self, queues: Sequence[str], *, fresh: bool = True) -> list[str]:
        """`queues` less the paused ones, in order; `fresh=False` trusts the view as it
        is, however old (a worker's claim that a new run woke: it reads after)."""
        if fresh:
            self.read_if_due()
        return [q for q in queues if q not in self._names]

    def read_if_due(self) -> None:
        now = time.monotonic()
        if now - self._read_at >= self.refresh:
            self._names = frozenset(PausedQueue.objects.values_list("name", flat=True))
            self._read_at = now
