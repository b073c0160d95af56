"""Flow control's tables: limit keys with their windows, and each recorded model call.

Models of the `django_agentruns` app, re-exported by `models`; they name the run table by
its label, so this module imports nothing of the package.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class AgentLimit(models.Model):
    """A limit key's row: the most runs of the key running at once across all workers, and
    until when the key is closed (a provider's 429). Claims of the key's runs lock it.

    A key with a row is claimed through the limited claim (transitions.limited); a key
    without one is unlimited and claimed like a run with no key.
    """

    key = models.CharField(max_length=200, primary_key=True)
    max_running = models.PositiveIntegerField(
        null=True, blank=True,
        help_text=_("Most runs of this key running at once; empty: the LIMITS setting, "
                  "else unlimited."))
    closed_until = models.DateTimeField(
        null=True, blank=True, help_text=_("No run of this key starts before then (a 429)."))
    closed_reason = models.CharField(max_length=255, blank=True, default="")
    per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Most runs of this key started per rolling minute; "
                                         "empty: the LIMITS setting, else unbounded.")
    tokens_per_minute = models.BigIntegerField(
        null=True, blank=True, help_text="Most tokens recorded per rolling minute; empty: the "
                                         "LIMITS setting, else unbounded.")
    cost_per_day = models.FloatField(
        null=True, blank=True, help_text="Most cost recorded per rolling day; empty: the "
                                         "LIMITS setting, else unbounded.")
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("key",)
        verbose_name = _("limit")
        verbose_name_plural = _("limits")

    def __str__(self) -> str:
        return self.key


class KeyWindowEntry(models.Model):
    """An attempt started under a windowed limit key: one start in its key's per-minute
    window, and the tokens and cost it reserved (an estimate) and used (`record_usage`).

    While its attempt is the run's running one it counts the larger of the two; once that
    attempt ended (or was lost and its run reclaimed) only what it used.
    """

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=200)
    run = models.ForeignKey("django_agentruns.AgentRun", on_delete=models.CASCADE, related_name="+",
                            db_index=False)  # agentruns_window_run leads with it
    attempt = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    reserved_tokens = models.BigIntegerField(default=0)
    reserved_cost = models.FloatField(default=0.0)
    used_tokens = models.BigIntegerField(default=0)
    used_cost = models.FloatField(default=0.0)

    class Meta:
        verbose_name = "key window entry"
        verbose_name_plural = "key window entries"
        indexes = (
            models.Index(fields=("key", "started_at"), name="agentruns_window_key"),
            models.Index(fields=("run", "attempt"), name="agentruns_window_run"),
        )

    def __str__(self) -> str:
        return f"{self.key}: run {self.run_id} attempt {self.attempt}"


class FairGroup(models.Model):
    """A fairness group of a queue: a keyed group's row turns fair order on while one of
    its runs lives (transitions.fair). The order itself is in the runs' stamps
    (`fair_vstart`); `vtime` is used by the queue's "" group only, as the queue's clock:
    the virtual now the reaper saw last, where enqueue starts when the queue is idle.
    """

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=100)
    key = models.CharField(max_length=200, blank=True)  # "": runs without a fair_key
    vtime = models.FloatField(default=0.0)

    class Meta:
        verbose_name = "fairness group"
        verbose_name_plural = "fairness groups"
        constraints = (models.UniqueConstraint(fields=("queue", "key"),
                                               name="agentruns_fair_group"),)

    def __str__(self) -> str:
        return f"{self.queue}/{self.key or '-'}"


class RunUsage(models.Model):
    """One model call's usage as `ctx.record_usage` recorded it, keyed by attempt and
    sequence: a write retried after a lost commit acknowledgement finds its key taken and
    adds nothing, so the run's totals (on AgentRun) count each call once."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey("django_agentruns.AgentRun", on_delete=models.CASCADE,
                            related_name="usage_records", db_index=False)  # agentruns_usage_key
    attempt = models.PositiveIntegerField()
    seq = models.PositiveIntegerField(help_text="The call's number within its attempt, from 1.")
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cost = models.FloatField(default=0.0)
    model = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = "usage record"
        ordering = ("run", "attempt", "seq")
        constraints = (
            models.UniqueConstraint(fields=("run", "attempt", "seq"), name="agentruns_usage_key"),
        )

    def __str__(self) -> str:
        return f"#{self.run_id} attempt {self.attempt} usage {self.seq}"
