"""The run list's filters. None of them counts or scans the table to list its choices.

Agent and queue choices come from the registry, not from `SELECT DISTINCT` over every
run; a run of an agent no longer registered is still found by searching its name.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Exists, Q, QuerySet
from django.http import HttpRequest
from django.utils import timezone

from ..conf import app_settings
from ..models import DEAD_LETTER_REASONS, AgentRun, Status
from ..registry import all_agents
from ..transitions import earlier_holder, holding_statuses
from ..worker import scope_policy

Choices = list[tuple[str, str]]


def dead_letters(qs: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    return qs.filter(status=Status.FAILED, reason__in=DEAD_LETTER_REASONS)


def stuck(qs: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    """Running with a lapsed lease: its worker is gone (or too slow to renew)."""
    return qs.filter(status=Status.RUNNING, lease_expires__lt=timezone.now())


def blocked(qs: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
    """Queued behind an earlier run of its scope: the claim's firing-order rule, inverted."""
    scopes = scope_policy()
    plain = scopes.ordered - scopes.dead_letters_block
    blocking = scopes.ordered & scopes.dead_letters_block
    held = Q(pk__in=[])
    if plain:
        held |= Q(agent__in=plain) & Q(Exists(earlier_holder(holding_statuses(False))))
    if blocking:
        held |= Q(agent__in=blocking) & Q(Exists(earlier_holder(holding_statuses(True))))
    return qs.filter(held, status=Status.QUEUED)


class AttentionFilter(admin.SimpleListFilter):
    title = "needs attention"
    parameter_name = "attention"
    filters = {
        "dead_letter": ("Dead letters", dead_letters),
        "stuck": ("Stuck (lease lapsed)", stuck),
        "blocked": ("Blocked (behind an earlier run of its scope)", blocked),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> Choices:
        return [(key, label) for key, (label, _) in self.filters.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[AgentRun]) -> QuerySet[AgentRun]:
        chosen = self.filters.get(self.value() or "")
        return queryset if chosen is None else chosen[1](queryset)


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
        return {spec.effective_queue() for spec in all_agents().values()} | {
            str(app_settings.DEFAULT_QUEUE)}
