"""Enqueues that act on the run holding a dedupe key: debounce (a queued holder takes the
newest input and a later start) and supersede (an unfinished holder is cancelled and gives
up the key to the new run), both race-free across processes.

The dedupe key's partial unique index stays the arbiter: at most one unfinished run of an
agent holds a key, so every path here is a compare-and-set on that holder, retried a few
rounds when another process changed it in between.
"""

from __future__ import annotations

from datetime import datetime

from django.db import OperationalError, transaction

from ..db import is_postgres, retry_on_lock
from ..models import UNFINISHED, AgentRun, RunPayload, Status
from ..payloads import INPUT, keep
from .enqueue import DEDUPE_ROUNDS, NewRun, insert_runs
from .operators import cancel


@retry_on_lock()
def enqueue_debounced(new: NewRun, at: datetime) -> AgentRun:
    """Queue `new` (it has a dedupe key), debounced: a queued run holding its key takes its
    input and start time instead (`debounced` True); else a new run, which gives up the key
    when it starts. A running or waiting holder that was not debounced is returned as a
    plain dedupe (`deduplicated` True), as `enqueue` does."""
    for _ in range(DEDUPE_ROUNDS):
        with transaction.atomic():
            holder = AgentRun.objects.filter(agent=new.agent, dedupe_key=new.dedupe_key,
                                             status=Status.QUEUED).values_list("pk", flat=True)
            holder_id = holder.first()
            if holder_id is not None:
                if AgentRun.objects.filter(pk=holder_id, status=Status.QUEUED,
                                           dedupe_key=new.dedupe_key).update(
                        available_at=new.available_at, release_dedupe_at_start=True):
                    # The newest input: a payload row after the older one (even {}).
                    RunPayload.objects.create(run_id=holder_id, kind=RunPayload.INPUT,
                                              value=new.input, created_at=at)
                    run = AgentRun.objects.get(pk=holder_id)
                    keep(run, INPUT, new.input)
                    run.debounced = True
                    return run
                continue  # started or replaced meanwhile: look again
            (run,) = insert_runs([new], at)
            if not run.deduplicated:
                AgentRun.objects.filter(pk=run.pk).update(release_dedupe_at_start=True)
                run.release_dedupe_at_start = True
                return run
            if run.status != Status.QUEUED:
                return run  # a holder that runs (or waits) and keeps its key
            # A queued holder appeared between the look and the insert: absorb into it.
    raise OperationalError("dedupe keys kept changing hands while enqueueing; try again")


@retry_on_lock()
def enqueue_superseding(new: NewRun, at: datetime) -> AgentRun:
    """Queue `new` (it has a dedupe key) in place of the unfinished run holding its key:
    that run gives up the key and is cancelled (a running one is asked to stop, as
    `cancel` does) with the reason "superseded by run N", in one transaction."""
    for _ in range(DEDUPE_ROUNDS):
        with transaction.atomic():
            holders = AgentRun.objects.filter(agent=new.agent, dedupe_key=new.dedupe_key,
                                              status__in=UNFINISHED)
            if is_postgres():
                holders = holders.select_for_update()
            holder_id = holders.values_list("pk", flat=True).first()
            if holder_id is not None:
                AgentRun.objects.filter(pk=holder_id, dedupe_key=new.dedupe_key).update(
                    dedupe_key="")
            (run,) = insert_runs([new], at)
            if not run.deduplicated:
                if holder_id is not None:
                    cancel(holder_id, f"superseded by run {run.pk}", at)
                return run
            # Another enqueue took the key first: roll this round back (the holder keeps
            # its key) and supersede that one.
            transaction.set_rollback(True)
    raise OperationalError("dedupe keys kept changing hands while enqueueing; try again")
