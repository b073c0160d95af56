"""The two tables: one row per run, and each run's append-only event stream.

Status is only ever written by `django_agentruns.transitions`; see docs/state_machine.md.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone

from .queries import RunQuerySet
from .states import DEAD_LETTER_REASONS, TERMINAL, Reason, Status

__all__ = ["DEAD_LETTER_REASONS", "TERMINAL", "AgentLimit", "AgentRun", "Reason", "RunEvent",
           "Status"]


class AgentRun(models.Model):
    id = models.BigAutoField(primary_key=True)
    agent = models.CharField(max_length=200)
    queue = models.CharField(max_length=100)
    priority = models.SmallIntegerField(default=0, help_text="Higher runs first.")
    scope = models.CharField(max_length=255, blank=True, default="")
    fired_seq = models.BigIntegerField(
        default=0, help_text="Firing order within the scope; ties are broken by id."
    )
    input = models.JSONField(default=dict, blank=True)
    output = models.JSONField(null=True, blank=True)

    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    reason = models.CharField(max_length=32, choices=Reason.choices, blank=True, default="")
    attempt = models.PositiveIntegerField(default=0, help_text="Attempts started so far.")
    requeue_count = models.PositiveIntegerField(default=0)
    max_requeues = models.PositiveIntegerField(default=3)

    claimed_by = models.CharField(max_length=255, blank=True, default="")
    lease_expires = models.DateTimeField(null=True, blank=True)
    available_at = models.DateTimeField(default=timezone.now)

    # Flow control (docs/limits.md): the run's limit key, resolved at enqueue ("" = none),
    # its snoozes (free requeues, up to MAX_SNOOZES), what it spent, and an operator's budget.
    limit_key = models.CharField(max_length=200, blank=True, default="")
    snooze_count = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cost = models.FloatField(default=0.0)
    budget = models.JSONField(null=True, blank=True,
                              help_text="Overrides the agent's budget (an operator's retry).")

    checkpoint_state = models.JSONField(null=True, blank=True)
    checkpoint_count = models.PositiveIntegerField(default=0)

    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.TextField(blank=True, default="")

    error_type = models.CharField(max_length=255, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    error_traceback = models.TextField(blank=True, default="")

    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    # Named reads (`.dead_letters()`, `.lapsed(at)`, ...): see django_agentruns.queries.
    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ("-id",)
        permissions = (
            ("retry_agentrun", "Can retry failed or cancelled runs"),
            ("cancel_agentrun", "Can cancel queued or running runs"),
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
            models.Index(fields=("created_at",), name="agentruns_created"),
        )

    def __str__(self) -> str:
        return f"{self.agent} #{self.pk} ({self.status})"

    @property
    def is_dead_letter(self) -> bool:
        return self.status == Status.FAILED and self.reason in DEAD_LETTER_REASONS


class AgentLimit(models.Model):
    """A limit key's row: the most runs of the key running at once across all workers, and
    until when the key is closed (a provider's 429). Claims of the key's runs lock it.

    A key with a row is claimed through the limited claim (transitions.limited); a key
    without one is unlimited and claimed like a run with no key.
    """

    key = models.CharField(max_length=200, primary_key=True)
    max_running = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Most runs of this key running at once; empty: the LIMITS setting, "
                  "else unlimited.")
    closed_until = models.DateTimeField(
        null=True, blank=True, help_text="No run of this key starts before then (a 429).")
    closed_reason = models.CharField(max_length=255, blank=True, default="")
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("key",)
        verbose_name = "limit"

    def __str__(self) -> str:
        return self.key


class RunEvent(models.Model):
    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveIntegerField(help_text="Position in the run's stream, from 1.")
    event_id = models.UUIDField(unique=True, help_text="Deterministic: a re-emit adds nothing.")
    type = models.CharField(max_length=100)
    payload = models.JSONField(default=dict, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("run", "seq")
        constraints = (
            models.UniqueConstraint(fields=("run", "seq"), name="agentruns_event_run_seq"),
        )

    def __str__(self) -> str:
        return f"#{self.run_id}.{self.seq} {self.type}"
