"""Child runs: spawning one in the parent's fenced write, and the parents their ends
resume. A child that finishes locks its parent (`waiting._locked`) before counting its
siblings, so the last of them to finish resumes it; `parents_behind` finds a parent a
crash left waiting.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction

from ..db import retry_on_lock
from ..exceptions import LimitExceeded
from ..models import TERMINAL, AgentRun, RunWait, Status
from ..outcomes import AttemptRef, Renewal
from .enqueue import NewRun, insert_runs
from .events import append_events, lifecycle, now
from .waiting import RUNS_PREFIX, SPAWNED, _locked, _renew, _resume


@retry_on_lock()
def spawn(ref: AttemptRef, key: str, new: NewRun, at: datetime | None = None, *,
          budget: dict[str, Any] | None = None, max_depth: int | None = None,
          max_children: int | None = None) -> tuple[Renewal, int | None]:
    """Enqueue a child run in the attempt's fenced write; the same key gives the same child
    in any later attempt (the unique constraint agentruns_spawn_key backs it). A new child
    past `max_children` of this run, or deeper than `max_depth`, is refused
    (`LimitExceeded`); `budget` is the child's own; a child given no fair key takes its
    parent's (a tenant's work stays in its fairness group)."""
    at = at or now()
    with transaction.atomic():
        row = _locked(ref.guard())
        if row is None:
            return Renewal.LOST, None
        if row["cancel_requested_at"] is not None:
            return Renewal.CANCEL_REQUESTED, None
        _renew(ref, at)
        known = AgentRun.objects.filter(parent_id=ref.run_id, spawn_key=key).values_list(
            "pk", flat=True).first()
        if known is not None:
            return Renewal.OK, known
        _check_tree(ref.run_id, max_depth, max_children)
        (child,) = insert_runs([new if new.fair_key else
                                new._replace(fair_key=row["fair_key"])], at)
        AgentRun.objects.filter(pk=child.pk).update(parent_id=ref.run_id, spawn_key=key,
                                                    budget=budget)
        append_events([lifecycle(ref.run_id, SPAWNED, ref.attempt, key=key, run=child.pk,
                                 agent=child.agent)], at)
    return Renewal.OK, child.pk


def _check_tree(run_id: int, max_depth: int | None, max_children: int | None) -> None:
    """Refuse a child that would pass the caps (settings MAX_SPAWN_DEPTH and
    MAX_CHILDREN_PER_RUN): a run spawning itself would otherwise grow without end."""
    if max_children is not None:
        count = AgentRun.objects.filter(parent_id=run_id).count()
        if count >= max_children:
            raise LimitExceeded(f"run {run_id} already has {count} child runs: "
                                f"MAX_CHILDREN_PER_RUN is {max_children}")
    if max_depth is not None:
        depth = _depth(run_id, max_depth)
        if depth + 1 > max_depth:
            raise LimitExceeded(f"a child of run {run_id} would be {depth + 1} levels below "
                                f"its root run: MAX_SPAWN_DEPTH is {max_depth}")


def _depth(run_id: int, most: int) -> int:
    """How many ancestors run `run_id` has (counted up to `most`, then it stops)."""
    depth, current = 0, run_id
    while depth < most:
        parent = AgentRun.objects.filter(pk=current).values_list("parent_id", flat=True).first()
        if parent is None:
            break
        depth, current = depth + 1, parent
    return depth


def children_settled(run_ids: Iterable[int], at: datetime) -> None:
    """Inside the transaction that finished `run_ids`: resume each parent whose wait for
    children they ended. One indexed read; nothing more for runs without a parent."""
    parents_settled(_parents_of(run_ids), at)


def parents_settled(parent_ids: Iterable[int | None], at: datetime) -> None:
    """`children_settled` for a caller that knows the finished runs' parents already (a
    settle's RETURNING): no read at all when none has a parent, as most runs have not."""
    for parent_id in sorted({p for p in parent_ids if p is not None}):
        _resume_if_children_done(parent_id, at)


def _parents_of(run_ids: Iterable[int]) -> list[int]:
    ids = list(run_ids)
    if not ids:
        return []
    parents = AgentRun.objects.filter(pk__in=ids, parent__isnull=False).values_list(
        "parent_id", flat=True)
    return sorted({p for p in parents if p is not None})


@retry_on_lock()
def resume_parents(parent_ids: Iterable[int | None], at: datetime | None = None) -> None:
    """`parents_settled` after a one-statement settle that committed on its own: a
    transaction only when some finished run has a parent."""
    parents = [p for p in parent_ids if p is not None]
    if parents:
        with transaction.atomic():
            parents_settled(parents, at or now())


def _resume_if_children_done(parent_id: int, at: datetime) -> bool:
    row = _locked(pk=parent_id, status=Status.WAITING, wait_key__startswith=RUNS_PREFIX)
    if row is None:
        return False
    prompt = RunWait.objects.filter(run_id=parent_id, key=row["wait_key"]).values_list(
        "prompt", flat=True).first() or {}
    ids = list(prompt.get("runs", []))
    if AgentRun.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).exists():
        return False
    RunWait.objects.filter(run_id=parent_id, key=row["wait_key"]).update(
        delivered_at=at, delivered_by="children")
    return _resume(parent_id, row["attempt"], at, key=row["wait_key"], runs=len(ids))


def parents_behind(limit: int, *, scan: int = 1000) -> list[int]:
    """Waiting parents whose awaited children are all finished: none, unless a worker died
    between a one-statement settle and `resume_parents` (the reaper resumes them).

    Judged by the children the wait names (its prompt's `runs`), not by every child: a
    parent may have spawned others it does not wait for, still unfinished. Candidates are
    parents with at least one finished child, at most `scan` of them per call."""
    finished = AgentRun.objects.filter(status__in=TERMINAL, parent_id__isnull=False)
    candidates = list(AgentRun.objects.filter(
        status=Status.WAITING, wait_key__startswith=RUNS_PREFIX,
        pk__in=finished.values("parent_id")).order_by("pk").values_list("pk", "wait_key")[:scan])
    if not candidates:
        return []
    waits = set(candidates)
    awaited: dict[int, list[int]] = {}
    for run_id, key, prompt in RunWait.objects.filter(
            run_id__in=[pk for pk, _ in candidates],
            key__in={key for _, key in candidates}).values_list("run_id", "key", "prompt"):
        if (run_id, key) in waits:
            awaited[run_id] = list((prompt or {}).get("runs", []))
    children = {c for ids in awaited.values() for c in ids}
    unfinished = set(AgentRun.objects.filter(pk__in=children).exclude(status__in=TERMINAL)
                     .values_list("pk", flat=True)) if children else set()
    stuck = [pk for pk, _ in candidates if pk in awaited and not unfinished & set(awaited[pk])]
    return stuck[:limit]


@retry_on_lock()
def resume_parent(parent_id: int, at: datetime | None = None) -> bool:
    with transaction.atomic():
        return _resume_if_children_done(parent_id, at or now())


def unfinished_children_of(run_ids: list[int]) -> list[tuple[int, int]]:
    """(parent, child) of every unfinished child of `run_ids`, in chunks of ids a query
    takes on any engine."""
    found: list[tuple[int, int]] = []
    for i in range(0, len(run_ids), 500):
        found.extend(AgentRun.objects.filter(parent_id__in=run_ids[i:i + 500])
                     .exclude(status__in=TERMINAL).order_by("pk")
                     .values_list("parent_id", "pk"))
    return found


def unfinished_children(run_id: int) -> list[int]:
    return list(AgentRun.objects.filter(parent_id=run_id).exclude(status__in=TERMINAL)
                .order_by("pk").values_list("pk", flat=True))
