"""The run list's filters. None of them counts or scans the table to list its choices.

Agent choices come from the registry, not from `SELECT DISTINCT` over every run; a run
of an agent no longer registered is still found by searching its name. Queue choices are
the queues of the newest QUEUE_SAMPLE runs (one range of the primary key, however large
the table), at most QUEUES_SHOWN of them, with the registry's and the default queue: a
queue named only by `enqueue(queue=...)` or a `django.tasks` task is offered too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from ..conf import app_settings
from ..models import AgentRun
from ..queries import RunQuerySet
from ..registry import all_agents, scope_policy

Choices = list[tuple[str, str]]
QUEUE_SAMPLE = 10_000
QUEUES_SHOWN = 100


def stuck(runs: RunQuerySet) -> RunQuerySet:
    """Running with a lapsed lease: its worker is gone (or too slow to renew)."""
    return runs.lapsed(timezone.now())


def blocked(runs: RunQuerySet) -> RunQuerySet:
    """Queued behind an earlier run of its scope: the claim's firing-order rule, inverted."""
    return runs.blocked(scope_policy())


class AttentionFilter(admin.SimpleListFilter):
    title = "needs attention"
    parameter_name = "attention"
    filters: dict[str, tuple[str, Callable[[RunQuerySet], RunQuerySet]]] = {
        "dead_letter": ("Dead letters", RunQuerySet.dead_letters),
        "stuck": ("Stuck (lease lapsed)", stuck),
        "blocked": ("Blocked (behind an earlier run of its scope)", blocked),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> Choices:
        return [(key, label) for key, (label, _) in self.filters.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
        chosen = self.filters.get(self.value() or "")
        # The changelist's queryset comes from the default manager: it has the named reads.
        return queryset if chosen is None else chosen[1](cast(RunQuerySet, queryset))


class _RegistryFilter(admin.SimpleListFilter):
    """Choices from the registry, plus the current value so a link to it keeps working."""

    field = ""

    def names(self) -> set[str]:
        raise NotImplementedError

    def lookups(self, request: HttpRequest, model_admin: Any) -> Choices:
        names = self.names()
        if self.value():
            names.add(str(self.value()))
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
        value = self.value()
        return queryset if value is None else queryset.filter(**{self.field: value})


class AgentFilter(_RegistryFilter):
    title = "agent"
    parameter_name = field = "agent"

    def names(self) -> set[str]:
        return set(all_agents())


class QueueFilter(_RegistryFilter):
    title = "queue"
    parameter_name = field = "queue"

    def names(self) -> set[str]:
        newest = AgentRun.objects.for_reading().order_by("-pk").values("pk")[:QUEUE_SAMPLE]
        used = (AgentRun.objects.for_reading().filter(pk__in=newest).order_by("queue")
                .values_list("queue", flat=True).distinct()[:QUEUES_SHOWN])
        return set(used) | {spec.effective_queue() for spec in all_agents().values()} | {
            str(app_settings.DEFAULT_QUEUE)}
