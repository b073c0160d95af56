"""Failover at the claim: queued runs of a key that cannot start now (closed, at its
`max_running`, or a window without room) move to the first key of their failover list that
is open and has room in all its windows.

Moving a run's key starts nothing: the claim of its new key, under that key's lock, still
decides whether it starts, so the limits hold whatever this reads. Only runs with a list,
only when the limited claim found a key without room: other claims pay nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db.models import Count

from ..models import AgentLimit, AgentRun, Status
from ..rules.windows import FIELDS, KeyLimits, is_pattern, resolve, row_limits, settings_table
from .guards import still
from .windows import WindowUse, full_window, window_use

MOVED_PER_CLAIM = 100  # runs looked at per claim: a backlog moves over a few claims


def move_to_open_keys(stuck: Iterable[str], at: datetime) -> int:
    """Move due runs of the `stuck` keys that have a failover list to the first key of it
    (in order) that is open and has room; returns how many moved."""
    stuck = sorted(set(stuck))
    runs = list(AgentRun.objects.filter(status=Status.QUEUED, limit_key__in=stuck,
                                        limit_keys__isnull=False, available_at__lte=at)
                .order_by("-priority", "available_at", "id")
                .values("id", "limit_key", "limit_keys")[:MOVED_PER_CLAIM])
    if not runs:
        return 0
    keys = sorted({k for r in runs if isinstance(r["limit_keys"], list)
                   for k in r["limit_keys"] if isinstance(k, str)})
    rows = {r["key"]: r for r in AgentLimit.objects.filter(key__in=keys)
            .values("key", "closed_until", *FIELDS)}
    patterns = {r["key"]: row_limits(r) for r in AgentLimit.objects.filter(key__endswith="*")
                .values("key", *FIELDS)}
    table = settings_table()
    limits = {k: resolve(k, row_limits(rows[k]) if k in rows else None, patterns, table)
              for k in keys if not is_pattern(k)}
    running = dict(AgentRun.objects.filter(status=Status.RUNNING, limit_key__in=keys)
                   .values_list("limit_key").annotate(n=Count("id")).order_by())
    uses = window_use([k for k, v in limits.items() if v.windowed], at)

    def room(key: str) -> bool:
        row, lim = rows.get(key), limits.get(key, KeyLimits())
        if row is not None and row["closed_until"] is not None and row["closed_until"] > at:
            return False
        if lim.max_running is not None and running.get(key, 0) >= lim.max_running:
            return False
        return full_window(lim, uses.get(key, WindowUse()), at) is None

    open_keys = {k for k in keys if room(k)}
    moved = 0
    for run in runs:
        listed = run["limit_keys"] if isinstance(run["limit_keys"], list) else []
        target = next((k for k in listed if k in open_keys), None)
        if target is not None and target != run["limit_key"]:
            moved += AgentRun.objects.filter(still(Status.QUEUED), pk=run["id"],
                                             limit_key=run["limit_key"]).update(limit_key=target)
    return moved
