"""Every write of a run's status, and every write an attempt makes, lives here.

Each transition is one short transaction: a guarded UPDATE (the row must still be in
the state the caller believes it is in) plus the event rows that tell the story. The
return value says whether it happened; a guard that matches no row is a result, not
an error. Nothing outside this package writes `AgentRun.status`.

Attempt writes (renew, emit, checkpoint, settle) are fenced by
`status='running' AND claimed_by=<worker> AND attempt=<n>`: a worker that lost its
lease cannot touch the run's new attempt.

One module per moment of a run: `enqueue` (new runs and forks), `due` (what may be claimed),
`claiming`, `attempts` (writes while it runs), `settling` (how it ends, and the reaper's
reclaim), `handover` (a worker's successes settled and its next runs claimed in one
statement), `operators` (cancel, retry, interactive runs); `batched` (an attempt's writes
as values, many applied in one transaction); `events` appends the story;
`rawsql` builds the hot path's statements once per shape (`rawrows` runs them);
`waiting` (the wait, deliveries, resumes, wait timeouts, child runs); `limited` (the
claim of runs whose limit key has a row, and that table's writes) and `snoozing`
(snoozes, recorded usage, budgets) are flow control; `steps` writes durable steps'
starts and ends.

Import direction (docs/architecture.md, enforced by tests/test_layers.py): UI/commands ->
api and queries -> transitions -> models; worker -> executor -> transitions. This package
imports only what lies below it (models, queries, outcomes, policy, signals, db, conf),
never the worker, the executor, the api, the admin or the UI.
"""

from __future__ import annotations

from ..outcomes import AttemptRef, CancelResult, ErrorInfo, Renewal, ScopePolicy, Settlement
from ..rules import policy
from . import children, waiting
from .attempts import checkpoint, emit, migrate_version, renew, renew_many
from .batched import (
    CheckpointWrite,
    EmitWrite,
    RenewWrite,
    Result,
    SettleWrite,
    SucceedWrite,
    UsageWrite,
    Write,
    apply_alone,
    apply_writes,
)
from .claiming import claim
from .due import awaited, due_elsewhere, due_queued, lapsed
from .enqueue import NewRun, insert_runs
from .events import (
    ABANDONED,
    CANCEL_REQUESTED,
    CANCELLED,
    CHECKPOINT,
    DEAD_LETTERED,
    FORKED,
    INTERRUPTED,
    RETRIED,
    RETRYING,
    SNOOZED,
    STARTED,
    SUCCEEDED,
    USAGE,
    emitted_event_id,
    lifecycle_event_id,
    now,
)
from .fair import drop_idle_groups, raise_clocks
from .forking import insert_fork
from .handover import settle_and_claim
from .limited import (
    claim_limited,
    close_key,
    limits_in_use,
    open_key,
    seed_settings_limits,
    write_limit,
)
from .operators import cancel, operator_retry, start_interactive
from .settling import (
    abandon,
    find_stale,
    interrupt,
    reap_one,
    settle_cancelled,
    settle_failed,
    settle_succeeded,
    settle_succeeded_many,
)
from .snoozing import exhaust_budget, record_usage, snooze
from .steps import STEP, CarriedEnd, StepEndWrite, StepStartWrite, end_step, start_step
from .superseding import enqueue_debounced, enqueue_superseding
from .windows import FullWindow, WindowUse, full_window, window_fill, window_use

__all__ = [
    "ABANDONED", "CANCELLED", "CANCEL_REQUESTED", "CHECKPOINT", "DEAD_LETTERED", "FORKED",
    "INTERRUPTED", "RETRIED", "RETRYING", "SNOOZED", "STARTED", "STEP", "SUCCEEDED", "USAGE",
    "AttemptRef", "CancelResult", "CarriedEnd", "CheckpointWrite", "EmitWrite", "ErrorInfo",
    "FullWindow", "NewRun", "RenewWrite", "Renewal", "Result", "ScopePolicy", "SettleWrite",
    "Settlement",
    "StepEndWrite", "StepStartWrite", "SucceedWrite", "UsageWrite", "WindowUse", "Write",
    "abandon", "apply_alone", "apply_writes", "awaited", "cancel", "checkpoint", "children",
    "claim",
    "claim_limited", "close_key", "drop_idle_groups", "due_elsewhere", "due_queued", "emit",
    "emitted_event_id", "end_step", "enqueue_debounced", "enqueue_superseding", "exhaust_budget",
    "find_stale",
    "full_window", "insert_fork", "insert_runs", "interrupt", "lapsed", "lifecycle_event_id",
    "limits_in_use", "migrate_version", "now", "open_key", "operator_retry", "policy",
    "raise_clocks", "reap_one",
    "record_usage", "renew", "renew_many", "seed_settings_limits", "settle_and_claim",
    "settle_cancelled", "settle_failed", "settle_succeeded", "settle_succeeded_many", "snooze",
    "start_interactive", "start_step", "waiting", "window_fill", "window_use", "write_limit",
]
