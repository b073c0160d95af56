"""The two tables: one row per run, and each run's append-only event stream.

Status is only ever written by `django_agentruns.transitions`; see docs/state_machine.md.
"""

from __future__ import annotations

from typing import Any

from django.db import models, router, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from .payloads import INPUT, OUTPUT, input_of, output_of, save_payloads, set_payload, unsaved
from .queries import STATE, TRACEBACK, RunQuerySet, load_states, traceback_of
from .states import DEAD_LETTER_REASONS, TERMINAL, UNFINISHED, Reason, Status

__all__ = ["DEAD_LETTER_REASONS", "TERMINAL", "UNFINISHED", "AgentLimit", "AgentRun",
           "FairGroup", "KeyWindowEntry", "PausedQueue", "Reason", "RunCheckpoint", "RunEvent",
           "RunPayload", "RunStep", "RunWait", "Schedule", "Status", "WorkerRecord"]


class AgentRun(models.Model):
    id = models.BigAutoField(primary_key=True)
    agent = models.CharField(max_length=200)
    queue = models.CharField(max_length=100)
    priority = models.SmallIntegerField(default=0, help_text=_("Higher runs first."))
    scope = models.CharField(max_length=255, blank=True, default="")
    fired_seq = models.BigIntegerField(
        default=0, help_text=_("Firing order within the scope; ties are broken by id.")
    )
    # Input and output are not columns: `RunPayload` rows (`input` and `output` below), so
    # the row that claims and renewals update holds no JSON document.

    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    reason = models.CharField(max_length=32, choices=Reason.choices, blank=True, default="")
    attempt = models.PositiveIntegerField(default=0, help_text=_("Attempts started so far."))
    requeue_count = models.PositiveIntegerField(default=0)
    max_requeues = models.PositiveIntegerField(default=3)

    claimed_by = models.CharField(max_length=255, blank=True, default="")
    lease_expires = models.DateTimeField(null=True, blank=True)
    available_at = models.DateTimeField(default=timezone.now)

    # Flow control (docs/limits.md): the run's limit key, resolved at enqueue ("" = none),
    # its snoozes (free requeues, up to MAX_SNOOZES), what it spent, and an operator's budget.
    limit_key = models.CharField(max_length=200, blank=True, default="")
    fair_key = models.CharField(max_length=200, blank=True, default="")  # its fairness group
    # Its virtual start, stamped at enqueue: the claim's order with fair shares on
    # (transitions.fair). Kept when the run is requeued. A database default too: an INSERT
    # that names no stamp (an older worker's, mid-deploy) still succeeds.
    fair_vstart = models.FloatField(default=0.0, db_default=0.0)
    snooze_count = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cost = models.FloatField(default=0.0)
    budget = models.JSONField(null=True, blank=True,
                              help_text=_("Overrides the agent's budget (an operator's retry)."))

    # The resume state is not a column: it is the checkpoint history's row number
    # `checkpoint_count` (`checkpoint_state` below), so a checkpoint rewrites no JSON here.
    checkpoint_count = models.PositiveIntegerField(default=0)
    agent_version = models.PositiveIntegerField(
        default=1, help_text=_("The agent's version the run started under (@agent(version=))."))

    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.TextField(blank=True, default="")

    error_type = models.CharField(max_length=255, blank=True, default="")
    error_message = models.TextField(blank=True, default="")  # the traceback: a RunPayload

    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    # Waiting (django_agentruns.waiting): the awaited key while `waiting`, its deadline, and
    # for a child run its parent and the key of the `ctx.spawn` that made it.
    wait_key = models.CharField(max_length=210, blank=True, default="")
    wait_until = models.DateTimeField(null=True, blank=True)
    # Its index holds only child runs (`agentruns_parent`): a new run inserts nothing there.
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="children", db_index=False)
    spawn_key = models.CharField(max_length=200, blank=True, default="")
    dedupe_key = models.CharField(
        max_length=255, blank=True, default="",
        help_text=_("While the run is unfinished, enqueueing its agent with this key returns it."))
    forked_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="forks",
        db_index=False,  # indexed for forks only (`agentruns_forked_from`)
        help_text=_("The run this one was forked from (`fork`), starting at one of its "
                  "checkpoints."))
    steps_copied = models.BooleanField(
        default=False, help_text=_("A fork given step records of its origin: its first "
                                   "attempt looks its steps up like any later one."))

    limit_keys = models.JSONField(
        null=True, blank=True, help_text="Failover: the limit keys the run may take, in order; "
                                         "a 429 on its key moves it to the next open one.")
    release_dedupe_at_start = models.BooleanField(
        default=False, help_text="Debounced: the claim that starts it gives up its dedupe key, "
                                 "so that a new enqueue with the key queues a new run.")

    # Set on the run `enqueue` returns: True when it is an existing unfinished run with the
    # same dedupe key rather than a new one. Not a column.
    deduplicated: bool = False
    # Set on the run `enqueue(debounce=...)` returns: True when an existing queued run took
    # the new input and start time. Not a column.
    debounced: bool = False

    # Named reads (`.dead_letters()`, `.lapsed(at)`, ...): see django_agentruns.queries.
    objects = RunQuerySet.as_manager()

    class Meta:
        verbose_name = _("agent run")
        verbose_name_plural = _("agent runs")
        ordering = ("-id",)
        permissions = (
            ("retry_agentrun", "Can retry failed or cancelled runs"),
            ("cancel_agentrun", "Can cancel queued or running runs"),
            ("approve_agentrun", "Can approve or reject what a waiting run proposes"),
            ("deliver_agentrun", "Can deliver input a waiting run asks for"),
        )
        indexes = (
            # The due query: queued runs of a queue in claim order. Partial, so it holds
            # only the backlog, whatever the size of the history.
            models.Index(
                fields=("queue", "-priority", "available_at", "fired_seq", "id"),
                condition=Q(status="queued"),
                name="agentruns_due",
            ),
            # Running runs, for the reaper and lapsed-lease claims. lease_expires is left
            # out on purpose: renewals then touch no indexed column and stay HOT updates.
            models.Index(fields=("id",), condition=Q(status="running"), name="agentruns_running"),
            # The ordered-scope check: is an earlier run of this scope still holding it?
            models.Index(
                fields=("agent", "scope", "status", "fired_seq", "id"), name="agentruns_scope_head"
            ),
            models.Index(fields=("status", "reason"), name="agentruns_status_reason"),
            # Limits per key: the running runs of a key (counted under the key's lock), and
            # the due runs of a key in claim order. Partial: runs with no key are not in them.
            models.Index(fields=("limit_key",), condition=Q(status="running") & ~Q(limit_key=""),
                         name="agentruns_key_running"),
            models.Index(fields=("limit_key", "-priority", "available_at", "fired_seq", "id"),
                         condition=Q(status="queued") & ~Q(limit_key=""),
                         name="agentruns_key_due"),
            # Failover at the claim: queued runs with a list, of a key without room.
            models.Index(fields=("limit_key",), name="agentruns_key_failover",
                         condition=Q(status="queued", limit_keys__isnull=False)),
            # Fair shares (transitions.fair): the claim's order, and a group's last stamp
            # for enqueue's next one.
            models.Index(fields=("queue", "-priority", "fair_vstart", "available_at",
                                 "fired_seq", "id"), condition=Q(status="queued"),
                         name="agentruns_fair_order"),
            models.Index(fields=("queue", "fair_key", "priority", "fair_vstart"),
                         condition=Q(status="queued"), name="agentruns_fair_last"),
            # ... and the highest stamp a queue's claims have started (its virtual now);
            # keyed runs only, so a claim without fair keys inserts nothing into it.
            models.Index(fields=("queue", "fair_vstart"), name="agentruns_fair_running",
                         condition=Q(status="running") & ~Q(fair_key="")),
            # A run's children and forks: partial, so the runs that are neither (nearly all,
            # and every new run enqueue inserts) cost these indexes nothing.
            models.Index(fields=("parent",), condition=Q(parent__isnull=False),
                         name="agentruns_parent"),
            models.Index(fields=("forked_from",), condition=Q(forked_from__isnull=False),
                         name="agentruns_forked_from"),
            models.Index(fields=("created_at",), name="agentruns_created"),
            # The overview's throughput chart and per-agent window: runs finished lately.
            models.Index(fields=("finished_at",), name="agentruns_finished"),
            # Waits whose deadline passed, for the reaper; only waiting runs with one.
            models.Index(fields=("wait_until",), name="agentruns_wait_until",
                         condition=Q(status="waiting", wait_until__isnull=False)),
        )
        constraints = (
            # A spawn key names one child of its parent, whatever attempt spawns it again.
            models.UniqueConstraint(fields=("parent", "spawn_key"), name="agentruns_spawn_key",
                                    condition=~Q(spawn_key="")),
            # One unfinished run per agent and dedupe key: the arbiter of enqueue's
            # INSERT ... ON CONFLICT DO NOTHING, race-free across processes. Partial, so a
            # finished run frees its key and keyless runs cost the index nothing.
            models.UniqueConstraint(
                fields=("agent", "dedupe_key"),
                condition=Q(status__in=UNFINISHED) & ~Q(dedupe_key=""),
                name="agentruns_dedupe",
            ),
        )

    def __str__(self) -> str:
        return f"{self.agent} #{self.pk} ({self.status})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Also the input and output set on this instance, as payload rows (same database,
        one transaction)."""
        if not unsaved(self):
            super().save(*args, **kwargs)
            return
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        with transaction.atomic(using=using):
            adding = self._state.adding
            super().save(*args, **kwargs)
            save_payloads(self, using, adding=adding)

    @property
    def is_dead_letter(self) -> bool:
        return self.status == Status.FAILED and self.reason in DEAD_LETTER_REASONS

    @property
    def checkpoint_state(self) -> Any:
        """The state of the run's last checkpoint (None before its first), read through from
        `RunCheckpoint` (number `checkpoint_count`) once and kept on this instance
        (`queries.load_states` reads many runs' at once).

        A run still at checkpoint 0 has no state to read, so it costs no query, except at a
        version above 1: a run migrated (`@agent(migrate=)`) before its first checkpoint keeps
        its migrated state as number 0."""
        load_states([self])
        return self.__dict__[STATE]

    @checkpoint_state.setter
    def checkpoint_state(self, state: Any) -> None:
        """This instance's view only (a migrated state just written): nothing is saved."""
        self.__dict__[STATE] = state

    @property
    def error_traceback(self) -> str:
        """The last error's traceback ("" if none): `queries.traceback_of`."""
        return traceback_of(self)

    @error_traceback.setter
    def error_traceback(self, text: str) -> None:
        self.__dict__[TRACEBACK] = text  # this instance's view only: nothing is saved

    @property
    def input(self) -> Any:
        """The run's input ({} if none), read through from its latest `RunPayload` of kind
        input once and kept on this instance (a claim returns it with the run). Setting it
        on an instance saves it with the instance's next `save()`."""
        return input_of(self)

    @input.setter
    def input(self, value: Any) -> None:
        set_payload(self, INPUT, value)

    @property
    def output(self) -> Any:
        """What the run returned (None until it succeeds), read through from its
        `RunPayload` of kind output once (a run that did not succeed costs no query).
        Setting it saves it with the instance's next `save()`."""
        return output_of(self)

    @output.setter
    def output(self, value: Any) -> None:
        set_payload(self, OUTPUT, value)

    def refresh_from_db(self, *args: Any, **kwargs: Any) -> None:
        for key in (STATE, TRACEBACK, INPUT, OUTPUT):
            self.__dict__.pop(key, None)
        super().refresh_from_db(*args, **kwargs)


class RunEvent(models.Model):
    id = models.BigAutoField(primary_key=True)
    # agentruns_event_run_seq leads with the run: no index of its own (0025)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="events",
                            db_index=False)
    seq = models.PositiveIntegerField(help_text=_("Position in the run's stream, from 1."))
    event_id = models.UUIDField(unique=True, help_text=_("Deterministic: a re-emit adds nothing."))
    type = models.CharField(max_length=100)
    payload = models.JSONField(default=dict, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = _("run event")
        verbose_name_plural = _("run events")
        ordering = ("run", "seq")
        constraints = (
            models.UniqueConstraint(fields=("run", "seq"), name="agentruns_event_run_seq"),
        )

    def __str__(self) -> str:
        return f"#{self.run_id}.{self.seq} {self.type}"


class WorkerRecord(models.Model):
    """A `runworker` process, as it last said it was: written by `django_agentruns.ops.workers`.

    Not a lease and never consulted by a claim: it only tells an operator (and `why`) which
    workers are alive and what they serve. A record whose `last_seen_at` is older than the
    lease TTL belongs to a worker that died or lost its database.
    """

    id = models.BigAutoField(primary_key=True)
    worker_id = models.CharField(max_length=255, unique=True)
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list)
    concurrency = models.PositiveIntegerField(default=1)
    agents = models.JSONField(default=list, help_text=_("Agent names registered in the worker."))
    version = models.CharField(max_length=50, blank=True, default="")
    started_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = _("worker record")
        verbose_name_plural = _("worker records")
        ordering = ("-last_seen_at",)
        indexes = (models.Index(fields=("last_seen_at",), name="agentruns_worker_seen"),)

    def __str__(self) -> str:
        return self.worker_id


class RunWait(models.Model):
    """One key a run receives on (`ctx.receive`, an approval, a wait for child runs).

    Written by `transitions.waiting` only. The row exists once the run waited for the key
    or a payload was delivered for it, whichever came first; the first payload stands.
    """

    class Kind(models.TextChoices):
        INPUT = "input", "Input"
        APPROVAL = "approval", "Approval"
        RUNS = "runs", "Child runs"

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="waits",
                            db_index=False)  # agentruns_wait_run_key leads with it
    key = models.CharField(max_length=210)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.INPUT)
    prompt = models.JSONField(null=True, blank=True, help_text=_("For whoever answers."))
    deadline = models.DateTimeField(null=True, blank=True)
    waited_at = models.DateTimeField(null=True, blank=True, help_text=_("Last time it waited."))
    timed_out_at = models.DateTimeField(null=True, blank=True)
    payload = models.JSONField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    delivered_by = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        verbose_name = _("run wait")
        verbose_name_plural = _("run waits")
        ordering = ("run", "id")
        constraints = (
            models.UniqueConstraint(fields=("run", "key"), name="agentruns_wait_run_key"),
        )

    def __str__(self) -> str:
        return f"#{self.run_id} {self.key}"


class RunCheckpoint(models.Model):
    """The latest checkpoints a run saved, not only the last: what `fork` starts a new run
    from.

    Written in the transaction that saves the checkpoint (`transitions.attempts` and
    `transitions.batched`), which also deletes the run's states older than the latest
    `CHECKPOINT_HISTORY`; number N is the run's checkpoint_count after it. A fork copies
    only its origin's state N, so its own numbers go on from there.
    """

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="checkpoints",
                            db_index=False)  # agentruns_checkpoint_number leads with it
    number = models.PositiveIntegerField(help_text=_("From 1, in the order saved."))
    state = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = _("run checkpoint")
        verbose_name_plural = _("run checkpoints")
        ordering = ("run", "number")
        constraints = (
            models.UniqueConstraint(fields=("run", "number"), name="agentruns_checkpoint_number"),
        )

    def __str__(self) -> str:
        return f"#{self.run_id} checkpoint {self.number}"


# Flow control's tables, the step, chunk and LangGraph tables written beside a run's
# events, and the operators' schedules and paused queues live in modules of their own,
# registered with the app here.
from .flow_models import AgentLimit, FairGroup, KeyWindowEntry, RunUsage  # noqa: E402, F401 (re-exported)
from .history_models import (  # noqa: E402, F401 (re-exported)
    GraphCheckpoint,
    GraphWrite,
    RunPayload,
    RunStep,
    StreamChunk,
    step_key,
)
from .operator_models import PausedQueue, Schedule  # noqa: E402 (re-exported)
