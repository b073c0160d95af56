"""Named reads of runs: what a dead letter, a lapsed lease or a blocked run is, written once.

`AgentRun.objects` is a `RunQuerySet`, so the admin, the metrics, retention, `why` and the
claim (`transitions.due`) all ask the same question the same way. Reads only: every status
write stays in `transitions`, which builds its due query from these reads and compiles it.
This module sits below `models` (which imports it) and imports no `transitions`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Self, TypeVar

from django.apps import apps as django_apps
from django.db import models
from django.db.models import Exists, F, OuterRef, Q

from .db import AmongUnindexed, NotListedIn, RowBefore, read_alias
from .outcomes import ScopePolicy
from .registry import version_rule
from .states import DEAD_LETTER_REASONS, TERMINAL, UNFINISHED, Status

if TYPE_CHECKING:
    from .models import AgentRun  # named in RunQuerySet's base and the state helpers


M = TypeVar("M", bound=models.Model)


def reading(queryset: models.QuerySet[M]) -> models.QuerySet[M]:
    """`queryset` on the read database (`READ_DATABASE`, a replica; else `default`): every
    operator's read that decides nothing (lists, overview, `why`, gauges, streams' catch-up)
    goes through here, and no write or read that decides a write does."""
    return queryset.using(read_alias())


def dead_letter() -> Q:
    """Failed for good, for one of `DEAD_LETTER_REASONS`: the condition, for a caller that
    composes a `Q` (retention); `RunQuerySet.dead_letters()` filters on it."""
    return Q(status=Status.FAILED, reason__in=DEAD_LETTER_REASONS)


def holding_statuses(blocking: bool) -> list[str]:
    """The statuses of an earlier run that hold its scope: queued, running or waiting, and
    failed too where the agent says dead letters block."""
    statuses: list[str] = [Status.QUEUED, Status.RUNNING, Status.WAITING]
    return [*statuses, Status.FAILED] if blocking else statuses


def _scope_groups(scopes: ScopePolicy) -> tuple[tuple[frozenset[str], bool], ...]:
    """Ordered agents split by whether dead letters block: each group is checked on its own,
    so that each EXISTS lists its statuses plainly and seeks the scope-head index once per
    status."""
    return ((scopes.ordered - scopes.dead_letters_block, False),
            (scopes.ordered & scopes.dead_letters_block, True))


def _paused_queue() -> type[models.Model]:
    """The PausedQueue model, from the app registry: `models` imports this module."""
    return django_apps.get_model("django_agentruns", "PausedQueue")


class RunQuerySet(models.QuerySet["AgentRun"]):
    """`AgentRun.objects`: the run table's named reads."""

    def _fresh(self) -> Self:
        """A new query of all runs, for a subquery that must not inherit this one's filters
        (it runs on the outer query's connection)."""
        return type(self)(self.model)

    def for_reading(self) -> Self:
        """These runs on the read database (see `reading`): a replica may lag, so nothing
        that decides a write reads through here."""
        return self.using(read_alias())

    def terminal(self) -> Self:
        """Finished: succeeded, failed or cancelled. Only an operator's retry moves one on."""
        return self.filter(status__in=TERMINAL)

    def unfinished(self) -> Self:
        """Queued or running (see `states.UNFINISHED`): what holds a dedupe key."""
        return self.filter(status__in=UNFINISHED)

    def holding_key(self, agent: str, dedupe_key: str) -> Self:
        """The unfinished run of `agent` with `dedupe_key` (at most one: `agentruns_dedupe`)."""
        return self.unfinished().filter(agent=agent, dedupe_key=dedupe_key)

    def unpaused(self) -> Self:
        """Runs whose queue is not paused. The claim's statement carries it, so a worker
        whose list of paused queues is a moment old still takes nothing from one."""
        return self.filter(NotListedIn(F("queue"), _paused_queue()._meta.db_table))

    def in_paused_queues(self) -> Self:
        """Runs of a paused queue (`why` and the admin say so)."""
        return self.filter(Exists(_paused_queue()._default_manager.filter(
            name=OuterRef("queue"))))

    def dead_letters(self) -> Self:
        """Failed for good (retries exhausted, not retryable): what an operator looks at."""
        return self.filter(dead_letter())

    def lapsed(self, at: datetime, queues: Iterable[str] | None = None) -> Self:
        """Running runs whose lease lapsed before `at`: their worker is gone (or too slow to
        count). The reaper and a claim take them back; the admin calls them stuck."""
        qs = self.filter(status=Status.RUNNING, lease_expires__lt=at)
        return qs if queues is None else qs.filter(queue__in=list(queues))

    def due(self, queues: Iterable[str], at: datetime) -> Self:
        """Queued runs of `queues` whose time has come, firing order per scope aside."""
        return self.filter(status=Status.QUEUED, queue__in=list(queues), available_at__lte=at)

    def of_agents(self, agents: frozenset[str] | None) -> Self:
        """Only runs of `agents` (None: of any agent).

        A worker claims only runs of agents it has, so that in a rolling deploy an old worker
        leaves a new agent's runs to a new worker instead of dead-lettering them. A filter on
        the due (or running) index's scan that no index on `agent` can serve: the claim keeps
        the due index's order whatever the planner's statistics say.
        """
        if agents is None:
            return self
        return self.filter(AmongUnindexed(F("agent"), sorted(agents)),
                           of_versions(version_rule(agents)))

    def ahead_in_scope(self) -> Self:
        """Runs of the outer run's agent and scope ahead of it in firing order (a subquery)."""
        return self.filter(
            RowBefore(F("fired_seq"), F("id"), OuterRef("fired_seq"), OuterRef("id")),
            agent=OuterRef("agent"), scope=OuterRef("scope"))

    def ahead_of(self, agent: str, scope: str, fired_seq: int, pk: int) -> Self:
        """Runs of `agent` and `scope` ahead of the run (`fired_seq`, `pk`) in firing order."""
        ahead = Q(fired_seq__lt=fired_seq) | Q(fired_seq=fired_seq, id__lt=pk)
        return self.filter(ahead, agent=agent, scope=scope)

    def holding(self, blocking: bool) -> Self:
        """Runs that hold their scope against later ones (see `holding_statuses`)."""
        return self.filter(status__in=holding_statuses(blocking))

    def startable(self, scopes: ScopePolicy) -> Self:
        """Keep the runs no earlier run of their scope holds back (ordered agents only)."""
        qs = self
        for agents, blocking in _scope_groups(scopes):
            if agents:
                holder = self._fresh().ahead_in_scope().holding(blocking)
                qs = qs.filter(~Q(agent__in=agents) | ~Exists(holder))
        return qs

    def held(self, scopes: ScopePolicy) -> Q | None:
        """The condition "an earlier run of its scope holds it back" (ordered agents only),
        for a caller that counts with it (the metrics); None when no agent is ordered."""
        held: Q | None = None
        for agents, blocking in _scope_groups(scopes):
            if agents:
                holder = self._fresh().ahead_in_scope().holding(blocking)
                group = Q(agent__in=agents) & Q(Exists(holder))
                held = group if held is None else held | group
        return held

    def blocked(self, scopes: ScopePolicy) -> Self:
        """Queued behind an earlier run of its scope: `startable`'s firing-order rule, inverted
        (whatever the run's due time)."""
        return self.filter(self.held(scopes) or Q(pk__in=[]), status=Status.QUEUED)

    def awaited(self, queues: Iterable[str], at: datetime, scopes: ScopePolicy) -> Self:
        """Queued runs due by time that a worker will get to without outside help.

        That is, all but those behind a run no worker releases: a dead letter (where the agent
        says it blocks), a run still backing off, or a waiting run. A burst worker whose claim
        came back empty waits while any of these remain (another worker holds them, or the run
        ahead of them), and exits past the rest.
        """
        qs = self.due(queues, at)
        for agents, blocking in _scope_groups(scopes):
            # Behind a run backing off, or waiting for a delivery: nobody here releases it.
            stuck = Q(status=Status.QUEUED, available_at__gt=at) | Q(status=Status.WAITING)
            if blocking:
                stuck |= Q(status=Status.FAILED)
            if agents:
                qs = qs.filter(~Q(agent__in=agents)
                               | ~Exists(self._fresh().ahead_in_scope().filter(stuck)))
        return qs


def of_versions(rule: tuple[tuple[str, int, bool], ...]) -> Q:
    """Runs this code may run (`registry.version_rule`): of version 1 for every agent at
    version 1; for an agent at version N, runs of version N, and older ones only if it
    has a `migrate`. A newer run waits for a worker with its code (it stays queued)."""
    pinned = [name for name, version, migrates in rule if version > 1 and not migrates]
    q = Q(agent_version__lte=1) & ~Q(agent__in=pinned) if pinned else Q(agent_version__lte=1)
    for name, version, migrates in rule:
        q |= Q(agent=name, agent_version__lte=version,
               agent_version__gte=1 if migrates else version)
    return q


STATE = "_checkpoint_state"  # where a run instance keeps its read-through resume state


def state_loaded(run: AgentRun) -> bool:
    """Whether reading `run.checkpoint_state` costs no query: read already, or nothing to
    read (no checkpoint yet, and a version of 1, which no migration wrote a state for)."""
    return STATE in run.__dict__ or run.pk is None or (
        not run.checkpoint_count and run.agent_version <= 1)


def load_states(runs: Iterable[AgentRun], using: str | None = None) -> None:
    """Read the resume state of each of `runs` not read yet, in one query: the checkpoint
    history's row number `checkpoint_count` of each (`AgentRun.checkpoint_state`). The
    worker's claim loop calls it for the runs a claim took, so attempts read nothing."""
    wanted: dict[int, AgentRun] = {}
    for run in runs:
        if STATE in run.__dict__:
            continue
        if state_loaded(run):
            run.__dict__[STATE] = None
        else:
            wanted[run.pk] = run
    if not wanted:
        return
    pairs = Q()
    for run in wanted.values():
        pairs |= Q(run_id=run.pk, number=run.checkpoint_count)
    first = next(iter(wanted.values()))
    found = dict(django_apps.get_model("django_agentruns", "RunCheckpoint")._base_manager
                 .using(using or first._state.db or "default").filter(pairs)
                 .values_list("run_id", "state"))
    for pk, run in wanted.items():
        run.__dict__[STATE] = found.get(pk)


TRACEBACK = "_error_traceback"  # where a run instance keeps its read-through traceback


def traceback_of(run: AgentRun) -> str:
    """The run's last error's traceback ("" if none): its latest `RunPayload` of kind
    traceback, read once and kept on the instance. A run without an error type (it never
    failed) costs no query."""
    if TRACEBACK not in run.__dict__:
        payloads = django_apps.get_model("django_agentruns", "RunPayload")
        run.__dict__[TRACEBACK] = "" if run.pk is None or not run.error_type else (
            payloads._base_manager.using(run._state.db or "default").filter(
                run_id=run.pk, kind=payloads.TRACEBACK).order_by("-id")
            .values_list("value", flat=True).first() or "")
    return str(run.__dict__[TRACEBACK])
