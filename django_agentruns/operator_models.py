"""Operators' tables: recurring runs (`Schedule`) and paused queues (`PausedQueue`).

Models of the `django_agentruns` app, re-exported by `models`; they name no other model,
so this module imports nothing of the package.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class Schedule(models.Model):
    """A recurring run of an agent: a cron expression or an interval in seconds.

    Workers serving the agent's queue tick it: each tick moves `last_tick` forward in one
    compare-and-set UPDATE and enqueues its run in the same transaction, so a tick runs once
    however many workers race for it (django_agentruns.schedules).
    """

    class Origin(models.TextChoices):
        CODE = "code", "@agent(schedule=/every=)"
        """Declared on the agent; workers keep the row in step with the code."""
        DATABASE = "database", "add_schedule / admin"
        """Added at run time; edited in the admin, removed by `remove_schedule`."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, unique=True)
    agent = models.CharField(max_length=200)
    cron = models.CharField(max_length=200, blank=True, default="",
                            help_text=_("Cron expression (5 fields), in `tz`."))
    every = models.PositiveIntegerField(null=True, blank=True,
                                        help_text=_("Seconds between ticks, aligned to the epoch."))
    tz = models.CharField(max_length=64, blank=True, default="",
                          help_text=_("IANA time zone of the cron expression; empty: TIME_ZONE."))
    input = models.JSONField(default=dict, blank=True,
                             help_text=_("Each run's input; its `tick` key is set to the tick."))
    catch_up = models.BooleanField(default=False,
                                   help_text=_("Run every missed tick, not only the latest."))
    enabled = models.BooleanField(default=True, help_text=_("Untick to pause the schedule."))
    origin = models.CharField(max_length=16, choices=Origin.choices, default=Origin.DATABASE)
    last_tick = models.DateTimeField(null=True, blank=True,
                                     help_text=_("The latest tick a run was enqueued for."))
    # A tick whose run cannot be enqueued (its input, its agent's limit_key) backs off:
    # written by the worker that failed it, cleared by the next tick that succeeds or by
    # an edit.
    failures = models.PositiveIntegerField(
        default=0, help_text=_("Ticks in a row whose run could not be enqueued."))
    retry_at = models.DateTimeField(
        null=True, blank=True, help_text=_("After a failed tick: no tick is tried before then."))
    last_error = models.TextField(blank=True, default="",
                                  help_text=_("Why the last failed tick's run was refused."))
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = _("schedule")
        verbose_name_plural = _("schedules")
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name


class PausedQueue(models.Model):
    """A queue workers claim nothing from until it is resumed (`pause_queue`)."""

    name = models.CharField(max_length=100, primary_key=True)
    paused_at = models.DateTimeField(default=timezone.now)
    paused_by = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        verbose_name = _("paused queue")
        verbose_name_plural = _("paused queues")
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name
