"""An attempt's writes as values, applied many at a time inside the caller's transaction.

The worker's attempt store (`runtime.attempt_store`) commits the writes of many attempts
together. Here they are applied without a savepoint each (nested `atomic()` blocks would
cost a SAVEPOINT and a RELEASE round trip per write) and by kind, not one by one: every
renewal and emit of a batch share one fenced UPDATE, every checkpoint one, every success
one more, and all their events one INSERT. Each write keeps its own fence: one whose
attempt lost the run comes back `Renewal.LOST` / `Settlement.LOST`, never an exception,
and the rest go on. The single-write guarantees hold here too: an emit past its run's
`max_events` raises `LimitExceeded` (the store then writes the batch's others without
it), a checkpoint's marker is left out past the cap, and a replayed checkpoint (its
number stored already) only renews. Any other end of an attempt (`SettleWrite`: failed,
cancelled, abandoned, interrupted, snoozed) runs its own transition in the same
transaction, as does recorded usage (`UsageWrite`, flow control).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from ..conf import SETTING_NAME
from ..exceptions import LimitExceeded
from ..models import AgentRun, Reason, RunEvent, Status
from ..outcomes import AttemptRef, Renewal, Settlement, StepStart, UsageTotals
from . import hot_sql, rawsql
from .alone import event_uuid, one_statement, write_alone
from .attempts import checkpoint, emit, renew, trim_history
from .children import parents_settled
from .events import CHECKPOINT, SUCCEEDED, lifecycle, lifecycle_event_id, now
from .settling import _announce_succeeded, insert_outputs, settle_succeeded, settle_succeeded_many
from .snoozing import record_usage, record_usage_in
from .steps import (
    CarriedEnd,
    StepEndWrite,
    StepStartWrite,
    close_steps,
    end_step,
    open_steps,
    start_step,
    unpacked,
)
from .writes import (
    CheckpointWrite,
    EmitWrite,
    Event,
    RenewWrite,
    Result,
    SettleWrite,
    SucceedWrite,
    UsageWrite,
    Write,
)

__all__ = ["CheckpointWrite", "EmitWrite", "Event", "RenewWrite", "Result", "SettleWrite",
           "SucceedWrite", "UsageWrite", "Write", "apply_writes", "stands_alone"]


def apply_writes(writes: Sequence[Write], at: datetime | None = None) -> list[Result]:
    """Apply `writes` in the current transaction; one result per write, in order.

    Must run inside `transaction.atomic()` (the caller commits them together), unless the
    writes stand alone (`stands_alone`): successes alone, or on PostgreSQL emits,
    checkpoints and renewals alone (one per run), commit in a statement of their own
    (`alone`), and both together, one run a write, in two. The effect is that of applying
    them one after another: writes to distinct runs are applied together, and a second
    write to a run starts a new round after the first.
    """
    if not connection.in_atomic_block:
        if one_statement(writes):
            return write_alone(writes, at or now(), _in_transaction)
        if two_statements(writes):
            return _alone_then_successes(writes, at or now())
        if not only_successes(writes):
            raise RuntimeError("apply_writes runs inside the caller's transaction")
        # Successes alone (a no-op agent's only write): settle_succeeded_many's own
        # statement, one on PostgreSQL, committed on its own.
        items = [(w.ref, w.output) for w in writes if isinstance(w, SucceedWrite)]
        settled = settle_succeeded_many(items[0][0].worker_id, items, at)
        return [settled[ref] for ref, _ in items]
    return _in_rounds(writes, at or now())


def _in_rounds(writes: Sequence[Write], at: datetime) -> list[Result]:
    """`apply_writes` in the caller's transaction: round after round of distinct runs."""
    # A carried step end goes just before the write carrying it, in the same round.
    flat, carried, answers = unpacked(writes)
    results: list[Result | None] = [None] * len(flat)
    round_: list[int] = []
    runs: set[int] = set()
    for i, write in enumerate(flat):
        if write.ref.run_id in runs and i - 1 not in carried:
            _apply_round(flat, round_, results, at, carried)
            round_, runs = [], set()
        round_.append(i)
        runs.add(write.ref.run_id)
    _apply_round(flat, round_, results, at, carried)
    done = [results[i] for i in answers]
    assert all(r is not None for r in results), "every write has its result"
    return [r for r in done if r is not None]


def _in_transaction(writes: Sequence[Write], at: datetime) -> list[Result]:
    """The writes in rounds, in a transaction of their own: `alone`'s way back for the
    writes its statement did not wholly make."""
    with transaction.atomic():
        return _in_rounds(writes, at)


def stands_alone(writes: Sequence[Write]) -> bool:
    """Whether `writes` commit in statements of their own, outside a transaction: the
    store then sends no BEGIN and no COMMIT for them (two round trips of four)."""
    return only_successes(writes) or one_statement(writes) or two_statements(writes)


def two_statements(writes: Sequence[Write]) -> bool:
    """Whether `writes` are successes of one worker beside what `write_alone` writes, every
    write of a distinct run: the successes the claim loop's statement could not take
    (they came while it ran) meet the other attempts' emits in the store's batches.
    Each write is fenced on its own and no two touch one run, so two statements, each
    committed on its own, write what one transaction would, without its rounds."""
    successes = [w for w in writes if isinstance(w, SucceedWrite)]
    if not successes or len(successes) == len(writes):
        return False
    others = [w for w in writes if not isinstance(w, SucceedWrite)]
    return len({w.ref.worker_id for w in successes}) == 1 and one_statement(others) \
        and len({w.ref.run_id for w in writes}) == len(writes)


def _alone_then_successes(writes: Sequence[Write], at: datetime) -> list[Result]:
    """`two_statements`' writes: the others in `write_alone`'s statement, then the
    successes in `settle_succeeded_many`'s. Should the second fail after the first
    committed, the store writes the batch again: a stored event or checkpoint is not
    written twice (their ids and numbers), and a renewal is a renewal."""
    others = [w for w in writes if not isinstance(w, SucceedWrite)]
    answered = dict(zip(map(id, others), write_alone(others, at, _in_transaction),
                        strict=True))
    items = [(w.ref, w.output) for w in writes if isinstance(w, SucceedWrite)]
    settled = settle_succeeded_many(items[0][0].worker_id, items, at)
    return [settled[w.ref] if isinstance(w, SucceedWrite) else answered[id(w)]
            for w in writes]


def _missed(refs: Sequence[AttemptRef]) -> dict[int, Renewal]:
    """Why each fenced UPDATE matched no row of these: the fence holds but a cancel was
    requested (rare), or the attempt lost the run."""
    if not refs:
        return {}
    fenced = dict(AgentRun.objects.filter(functools.reduce(
        operator.or_, [r.guard() for r in refs])).values_list("pk", "cancel_requested_at"))
    return {r.run_id: Renewal.LOST if r.run_id not in fenced
            else Renewal.CANCEL_REQUESTED if fenced[r.run_id] is not None else Renewal.OK
            for r in refs}


def only_successes(writes: Sequence[Write]) -> bool:
    """Whether `writes` are successes of distinct runs of one worker: what
    `settle_succeeded_many` writes in one statement of its own, outside a transaction."""
    return bool(writes) and all(isinstance(w, SucceedWrite) for w in writes) \
        and len({w.ref.run_id for w in writes}) == len(writes) \
        and len({w.ref.worker_id for w in writes}) == 1


def _apply_round(writes: Sequence[Write], positions: list[int],
                 results: list[Result | None], at: datetime,
                 carried: set[int] | None = None) -> None:
    """Writes to distinct runs: no order among them matters; but a carried step end (its
    position in `carried`) and the write after it, of one run, go in that order."""
    if not positions:
        return
    events: list[Event] = []
    caps: list[int | None] = []
    emits: dict[int, EmitWrite] = {}
    # Durable steps' starts and ends renew in the same UPDATE (see `_steps`).
    renewing = [i for i in positions if isinstance(writes[i], RenewWrite | EmitWrite
                                                    | StepStartWrite | StepEndWrite)
                and not _despite_cancel(writes[i])]
    # A carried end whose carrier renews takes its carrier's answer (one fence, one row).
    riding: set[int] = set()
    if carried:
        renews = set(renewing)
        riding = {i for i in renewing if i in carried and i + 1 in renews}
        renewing = [i for i in renewing if i not in riding]
    storing = [i for i in positions if _despite_cancel(writes[i])]
    for i in _fenced(writes, renewing, results, [(LEASE, TIMESTAMP)],
                     lambda w: (w.ref.lease_until(at),)) + \
            _fenced(writes, storing, results, [(LEASE, TIMESTAMP)],
                    lambda w: (w.ref.lease_until(at),), despite_cancel=True):
        write = writes[i]
        if isinstance(write, EmitWrite):
            events.append((write.ref.run_id, write.type, write.payload, write.ref.attempt,
                           write.event_id))
            caps.append(write.max_events)
            emits[write.ref.run_id] = write
    for i in riding:
        results[i] = results[i + 1]
    pointing = [i for i in positions if isinstance(writes[i], CheckpointWrite)]
    saved = _fenced(writes, pointing, results, CHECKPOINT_FIELDS,
                    lambda w: (w.ref.lease_until(at), _state(w)[1]), below="checkpoint_count")
    for i in saved:
        write = writes[i]
        assert isinstance(write, CheckpointWrite)
        events.append(lifecycle(write.ref.run_id, CHECKPOINT, write.ref.attempt,
                                count=write.count))
        caps.append(write.max_events)
    if saved:
        # The latest states are kept (`fork` starts from one), in this transaction.
        rows = [(writes[i].ref.run_id, *_state(writes[i])) for i in saved]
        sql, params = rawsql.insert_checkpoints(rows, at)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
        newest: dict[int, int] = {}
        for run_id, _saved, number in rows:
            newest[run_id] = max(number, newest.get(run_id, 0))
        trim_history(list(newest.items()))
    # A checkpoint not saved may be a replay (its number stored already): it only renews.
    replays = [i for i in pointing if i not in saved and results[i] is Renewal.OK]
    _fenced(writes, replays, results, [(LEASE, TIMESTAMP)], lambda w: (w.ref.lease_until(at),))
    # Steps' events first: a carried end's goes before its carrier's (its run's next seq).
    stepped, step_caps = _steps(writes, positions, results, at)
    events[:0], caps[:0] = stepped, step_caps
    succeeding = [i for i in positions if isinstance(writes[i], SucceedWrite)]
    ended = _succeed(writes, succeeding, results, at)
    if events or ended:
        sql, params = rawsql.insert_new_events(events + ended, at,
                                               caps + [None] * len(ended))
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            added = {event_uuid(row[1]) for row in cursor.fetchall()}
        _refuse_over_cap([w for w in emits.values() if w.event_id not in added])
    for i in positions:
        write = writes[i]
        if isinstance(write, SettleWrite):
            results[i] = write.settle()
        elif isinstance(write, UsageWrite):
            results[i] = _usage(write, at)


def _steps(writes: Sequence[Write], positions: list[int], results: list[Result | None],
           at: datetime) -> tuple[list[Event], list[int | None]]:
    """Durable steps' starts and ends, renewed with the round's emits: the starts whose
    fence held opened in one INSERT (`open_steps`), the ends stored in one statement
    (`close_steps`); returns their `run.step` events and caps, for the round's INSERT. An
    end is recorded under a cancel request too (the fence holds); nothing of a write
    whose attempt lost the run."""
    starting = [i for i in positions if isinstance(writes[i], StepStartWrite)]
    opened = [i for i in starting if results[i] is Renewal.OK]
    for i in starting:
        if results[i] is not Renewal.OK:
            renewal = results[i]
            assert isinstance(renewal, Renewal)
            results[i] = StepStart(renewal)
    if opened:
        starts = [w for w in (writes[i] for i in opened) if isinstance(w, StepStartWrite)]
        for i, answer in zip(opened, open_steps(starts, at), strict=True):
            results[i] = answer
    ends = [w for w in (writes[i] for i in positions if results[i] is not Renewal.LOST)
            if isinstance(w, StepEndWrite)]
    if not ends:
        return [], []
    events = close_steps(ends, at)
    cap = {w.ref.run_id: w.max_events for w in ends}
    return events, [cap[event[0]] for event in events]


def _refuse_over_cap(missing: list[EmitWrite]) -> None:
    """Emits the INSERT left out: a replay (its id stored already) is fine; one refused by
    its run's cap fails, as `transitions.emit` does (the store retries the others alone)."""
    if not missing:
        return
    # By run too: partitioned history is keyed (run_id, event_id), one partition a run.
    stored = set(RunEvent.objects.filter(run_id__in={w.ref.run_id for w in missing},
                                         event_id__in=[w.event_id for w in missing])
                 .values_list("event_id", flat=True))
    for write in missing:
        if write.event_id not in stored and write.max_events is not None:
            raise LimitExceeded(
                f"run {write.ref.run_id} holds {write.max_events} events, the most "
                f"{SETTING_NAME}['MAX_EVENTS_PER_RUN'] allows; the event {write.type!r} "
                f"was not recorded")


def _despite_cancel(write: Write) -> bool:
    return isinstance(write, EmitWrite) and write.despite_cancel


def _state(write: Write) -> tuple[Any, int]:
    assert isinstance(write, CheckpointWrite)
    return write.state, write.count


LEASE, TIMESTAMP = "lease_expires", "timestamptz"
# The state itself goes only to the checkpoint history (`rawsql.insert_checkpoints`).
CHECKPOINT_FIELDS = [(LEASE, TIMESTAMP), ("checkpoint_count", "integer")]


def _fenced(writes: Sequence[Write], positions: list[int], results: list[Result | None],
            fields: list[tuple[str, str]], values: Callable[[Write], tuple[Any, ...]],
            below: str | None = None, despite_cancel: bool = False) -> list[int]:
    """One fenced UPDATE for the writes at `positions`, setting `fields` to `values(write)`
    (with `below`, only where that field's stored value is less); records each one's
    Renewal (OK for a fence that holds with `below` unmet) and returns the positions
    it updated. With `despite_cancel` a run with a cancel request is updated too, its
    Renewal CANCEL_REQUESTED."""
    if not positions:
        return []
    refs = {i: writes[i].ref for i in positions}
    sql, params = rawsql.fenced_update(
        [(r.run_id, r.attempt, r.worker_id, *values(writes[i])) for i, r in refs.items()],
        Status.RUNNING, fields, below=below, despite_cancel=despite_cancel)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        returned = cursor.fetchall()
    done = {row[0] for row in returned}
    cancelled = {row[0] for row in returned if despite_cancel and row[1] is not None}
    # Rare: a cancel request (the fence holds) or a lost lease (it does not); with
    # `below`, a value not below the stored one (the fence holds, no cancel request: OK,
    # the UPDATE was not needed).
    missed = _missed([r for r in refs.values() if r.run_id not in done])
    for i, ref in refs.items():
        if ref.run_id in cancelled:
            results[i] = Renewal.CANCEL_REQUESTED
        else:
            results[i] = Renewal.OK if ref.run_id in done else missed[ref.run_id]
    return [i for i in positions if refs[i].run_id in done]


def _succeed(writes: Sequence[Write], positions: list[int], results: list[Result | None],
             at: datetime) -> list[Event]:
    """One fenced UPDATE per worker for the successes (settle_succeeded_many's two-statement
    form: its one-statement form may collide on a seq, which would abort the whole batch);
    returns their end events, for the round's INSERT."""
    by_worker: dict[str, list[int]] = {}
    for i in positions:
        by_worker.setdefault(writes[i].ref.worker_id, []).append(i)
    ended: list[Event] = []
    for worker_id, group in by_worker.items():
        items = [(w.ref, w.output) for w in (writes[i] for i in group)
                 if isinstance(w, SucceedWrite)]
        rows = [(ref.run_id, ref.attempt, output, lifecycle_event_id()) for ref, output in items]
        sql, params = hot_sql.settle_succeeded(rows, worker_id, Status.RUNNING, Status.SUCCEEDED,
                                              Reason.COMPLETED, SUCCEEDED, at,
                                              with_events=False)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            settled: dict[int, int | None] = dict(cursor.fetchall())  # id: parent_id
            outputs = insert_outputs(rows, settled, at)
            if outputs is not None:
                cursor.execute(*outputs)
        done = set(settled)
        ended += [(run_id, SUCCEEDED, {}, attempt, event_id)
                  for run_id, attempt, _, event_id in rows if run_id in done]
        parents_settled(settled.values(), at)
        _announce_succeeded(items, done)
        for i, (ref, _) in zip(group, items, strict=True):
            results[i] = Settlement.SUCCEEDED if ref.run_id in done else Settlement.LOST
    return ended


def _usage(write: UsageWrite, at: datetime) -> UsageTotals:
    """One usage write, in the batch's transaction (rarer than emits: no shared UPDATE)."""
    return record_usage_in(write.ref, write.input_tokens, write.output_tokens, write.cost,
                           write.model, at, max_events=write.max_events, seq=write.seq)


def apply_alone(write: Write) -> Result:
    """One write in its own transaction, by the single-write transition it stands for: the
    path of an attempt with no attempt store (`run_now`, a context built in a test)."""
    if isinstance(write, RenewWrite):
        return renew(write.ref)
    if isinstance(write, EmitWrite):
        return emit(write.ref, write.event_id, write.type, write.payload,
                    max_events=write.max_events, despite_cancel=write.despite_cancel)
    if isinstance(write, CheckpointWrite):
        return checkpoint(write.ref, write.state, write.count, max_events=write.max_events)
    if isinstance(write, SucceedWrite):
        return settle_succeeded(write.ref, write.output)
    if isinstance(write, UsageWrite):
        return record_usage(write.ref, write.input_tokens, write.output_tokens, write.cost,
                            write.model, max_events=write.max_events, seq=write.seq)
    if isinstance(write, StepStartWrite):
        return start_step(write)
    if isinstance(write, StepEndWrite):
        return end_step(write)
    if isinstance(write, CarriedEnd):
        apply_alone(write.end)
        return apply_alone(write.then)
    return write.settle()
