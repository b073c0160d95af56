"""A fork: a new run of a run's agent from one of its checkpoints (`api.fork`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import connection, transaction

from ..exceptions import InvalidInputError
from ..models import AgentRun, RunCheckpoint, RunStep, Status
from .events import FORKED, append_events, lifecycle
from .fair import join_groups, next_stamp


def insert_fork(
    origin_id: int, number: int | None, input: Any, by: str, at: datetime, *,
    replay: bool = False, agent: str | None = None, queue: str | None = None,
    version: int | None = None, limit_key: str | None = None, fair_key: str | None = None,
) -> AgentRun | None:
    """Queue a new run of `origin_id`'s agent starting from its checkpoint `number` (None:
    its last; with none saved, from the start), with `input` (None: the origin's),
    `limit_key` and `fair_key` (None: the origin's: a fork is its tenant's work, in its
    fairness group, which it joins like a new run).

    One transaction: the new run, a copy of the ONE state it starts from (checkpoint N, as
    its own checkpoint N: its numbers go on from N, as its `checkpoint_count` does, and a
    fork of the fork can start from N again), and a `run.forked` event opening its
    timeline. None of the origin's other history is copied, and nothing of the fork points
    into the origin's rows, so purging the origin, or trimming its history past
    `CHECKPOINT_HISTORY`, never breaks the fork. The origin and its timeline are not
    touched. None: no such run; `InvalidInputError` for a checkpoint the run never reached
    or no longer keeps (nothing written).

    Steps: with `replay`, every step the origin completed is copied (the fork gets their
    results without executing them, and records no usage for them); without, those
    started before the checkpoint the fork starts from (it does not call them again).
    `agent`: the fork runs that agent (on `queue`, at `version`), keeping the origin's
    limit key.
    """
    with transaction.atomic():
        origin = AgentRun.objects.filter(pk=origin_id).first()
        if origin is None:
            return None
        n = origin.checkpoint_count if number is None else number
        if n:
            saved = origin.checkpoints.filter(number=n).exists()
            if n > origin.checkpoint_count or not saved:
                raise InvalidInputError(
                    f"Run {origin_id} has no checkpoint {n}: it saved "
                    f"{origin.checkpoint_count}" + ("" if n > origin.checkpoint_count else
                                                    " and keeps only its latest ones "
                                                    "(CHECKPOINT_HISTORY; a fork keeps the "
                                                    "one it started from)"))
        run = AgentRun(
            agent=agent or origin.agent, queue=queue or origin.queue, priority=origin.priority,
            limit_key=origin.limit_key if limit_key is None else limit_key,
            fair_key=origin.fair_key if fair_key is None else fair_key,
            agent_version=version or origin.agent_version,
            scope=origin.scope, fired_seq=origin.fired_seq,
            max_requeues=origin.max_requeues,
            status=Status.QUEUED, available_at=at, created_at=at,
            checkpoint_count=n, forked_from=origin, steps_copied=replay or bool(n))
        run.fair_vstart = next_stamp(run.queue, run.fair_key, run.priority)
        run.input = origin.input if input is None else input  # a payload row, saved with it
        run.save(force_insert=True)
        if run.fair_key:
            join_groups([(run.queue, run.fair_key)])
        if n:
            table = connection.ops.quote_name(RunCheckpoint._meta.db_table)
            with connection.cursor() as cursor:  # copied in the database: no state loaded
                cursor.execute(
                    f"INSERT INTO {table} (run_id, number, state, created_at) "
                    f"SELECT %s, number, state, created_at FROM {table} "
                    f"WHERE run_id = %s AND number = %s", [run.pk, origin_id, n])
        _copy_steps(origin_id, run.pk, None if replay else n)
        extra: dict[str, Any] = {"replay": True} if replay else {}
        if run.agent != origin.agent:
            extra["agent"] = run.agent
        append_events([lifecycle(run.pk, FORKED, 0, origin=origin_id, checkpoint=n, by=by,
                                 input_replaced=input is not None, **extra)], at)
    return run


def _copy_steps(origin_id: int, run_id: int, before: int | None) -> None:
    """Copy the origin's done steps (those started before checkpoint `before`; None: all)
    into the fork, in the database: the fork never reads the origin's again, so purging
    the origin leaves it whole. A copy costs nothing: its usage is zero."""
    if before == 0:
        return
    table = connection.ops.quote_name(RunStep._meta.db_table)
    columns = ("name, occurrence, status, result, error, attempt, checkpoint, started_at, "
               "finished_at")
    condition = "" if before is None else " AND checkpoint < %s"
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (run_id, replayed_from, input_tokens, output_tokens, cost, "
            f"{columns}) SELECT %s, id, 0, 0, 0.0, {columns} FROM {table} "
            f"WHERE run_id = %s AND status = %s{condition}",
            [run_id, origin_id, RunStep.State.DONE, *([] if before is None else [before])])
