"""Windows of limit keys, counted under the key's lock: starts per rolling minute, tokens per
rolling minute, cost per rolling day (django_agentruns.rules.windows says what a key allows).

An attempt started under a windowed key writes one `KeyWindowEntry`, stamped with its
start, reserving an estimate; `record_usage` adds what it used. While the attempt is its
run's running one it counts the larger of the two; after (finished, or lost and its run
reclaimed) only what it used: a crash gives its reservation back, and an overspend only
leaves the window less room, never stops the run.

Only keys with a window pay for this: one INSERT of the entries of the runs a claim
started; the aggregate read shares the statement that counts the keys' running runs
(`running_and_window_use`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.db import connection
from django.db.models import (
    Avg,
    Case,
    Count,
    Exists,
    F,
    FloatField,
    Min,
    OuterRef,
    Q,
    Sum,
    When,
)
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ..models import AgentLimit, AgentRun, KeyWindowEntry, Status
from ..registry import find_agent
from ..rules.windows import (
    DAY,
    FIELDS,
    MINUTE,
    KeyLimits,
    best_pattern,
    is_pattern,
    resolve,
    row_limits,
    settings_table,
)


@dataclass(frozen=True)
class WindowUse:
    """What a key's windows hold at a time, and when their oldest entries leave."""

    starts: int = 0
    tokens: float = 0.0
    cost: float = 0.0
    oldest_minute: datetime | None = None
    oldest_day: datetime | None = None
    average_tokens: float = 0.0  # per ended attempt, the last day: the default estimate
    average_cost: float = 0.0


def _live() -> Exists:
    return Exists(AgentRun.objects.filter(pk=OuterRef("run_id"), status=Status.RUNNING,
                                          attempt=OuterRef("attempt")))


def _window_rows(keys: list[str], at: datetime) -> Any:
    """The aggregate of `keys`' entries at `at`, a row per key with an entry (the columns
    of `_use_of`, in order)."""
    minute, day = at - timedelta(seconds=MINUTE), at - timedelta(seconds=DAY)
    in_minute = Q(started_at__gt=minute)
    tokens = Case(When(live=True, then=Greatest("reserved_tokens", "used_tokens")),
                  default=F("used_tokens"), output_field=FloatField())
    cost = Case(When(live=True, then=Greatest("reserved_cost", "used_cost")),
                default=F("used_cost"), output_field=FloatField())
    return (KeyWindowEntry.objects.filter(key__in=keys, started_at__gt=day)
            .annotate(live=_live()).values("key").order_by("key").annotate(
        starts=Count("id", filter=in_minute),
        tokens=Coalesce(Sum(tokens, filter=in_minute), 0.0, output_field=FloatField()),
        cost=Coalesce(Sum(cost), 0.0, output_field=FloatField()),
        oldest_minute=Min("started_at", filter=in_minute),
        oldest_day=Min("started_at"),
        average_tokens=Coalesce(Avg("used_tokens", filter=Q(live=False)), 0.0,
                                output_field=FloatField()),
        average_cost=Coalesce(Avg("used_cost", filter=Q(live=False)), 0.0,
                              output_field=FloatField())))


_USE_COLUMNS = ("starts", "tokens", "cost", "oldest_minute", "oldest_day", "average_tokens",
                "average_cost")


def _use_of(values: Sequence[Any]) -> WindowUse:
    starts, tokens, cost, oldest_minute, oldest_day, average_tokens, average_cost = values
    return WindowUse(int(starts), float(tokens), float(cost), _time(oldest_minute),
                     _time(oldest_day), float(average_tokens), float(average_cost))


def _time(value: Any) -> datetime | None:
    """A time read by a raw cursor as the ORM would give it (SQLite: text, UTC)."""
    if isinstance(value, str):
        value = parse_datetime(value)
        if value is not None and settings.USE_TZ and timezone.is_naive(value):
            value = timezone.make_aware(value, UTC)
    return cast("datetime | None", value)


def window_use(keys: Iterable[str], at: datetime) -> dict[str, WindowUse]:
    """The windows of `keys` at `at`, in one statement (keys with no entry: empty)."""
    keys = sorted(set(keys))
    if not keys:
        return {}
    return {r["key"]: _use_of([r[c] for c in _USE_COLUMNS]) for r in _window_rows(keys, at)}


def running_and_window_use(keys: Sequence[str], windowed: Sequence[str], at: datetime,
                           ) -> tuple[dict[str, int], dict[str, WindowUse]]:
    """The limited claim's read under its keys' locks: each key's running runs, and the
    windows of its `windowed` keys, in ONE statement (a UNION ALL of the two aggregates,
    one snapshot): a key with windows adds no read to its claims, only the INSERT of its
    runs' entries. Without windowed keys, the running count as it always was."""
    running = (AgentRun.objects.filter(status=Status.RUNNING, limit_key__in=keys)
               .values_list("limit_key").annotate(n=Count("id")).order_by())
    if not windowed:
        return dict(running), {}
    r_sql, r_params = running.query.sql_with_params()
    w_sql, w_params = _window_rows(sorted(set(windowed)), at).query.sql_with_params()
    key, nulls = connection.ops.quote_name("key"), ", ".join(["NULL"] * len(_USE_COLUMNS))
    uses = ", ".join(f"w.{connection.ops.quote_name(c)}" for c in _USE_COLUMNS)
    sql = (f"SELECT 0, r.limit_key, r.n, {nulls} FROM ({r_sql}) r UNION ALL "
           f"SELECT 1, w.{key}, NULL, {uses} FROM ({w_sql}) w")
    counts: dict[str, int] = {}
    use: dict[str, WindowUse] = {}
    with connection.cursor() as cursor:
        cursor.execute(sql, [*r_params, *w_params])
        for kind, name, n, *values in cursor.fetchall():
            if kind == 0:
                counts[name] = int(n)
            else:
                use[name] = _use_of(values)
    return counts, use


def start_room(limits: KeyLimits, use: WindowUse) -> int | None:
    """How many more runs the per-minute window lets start (None: no such window)."""
    if limits.per_minute is None:
        return None
    return max(0, limits.per_minute - use.starts)


def estimate_of(agent: str, use: WindowUse) -> tuple[int, float]:
    """A run's reservation: its agent's `estimate`, else the key's recent average."""
    spec = find_agent(agent)
    est = getattr(spec, "estimate", None) if spec is not None else None
    tokens = est.tokens if est is not None and est.tokens is not None \
        else round(use.average_tokens)
    cost = est.cost if est is not None and est.cost is not None else use.average_cost
    return int(tokens), float(cost)


class Admission:
    """The token and cost windows of one key during one claim: a run picked is let in
    while the windows' use, its reservations so far included, is under their size (so an
    estimate larger than the window cannot hold a key forever)."""

    def __init__(self, limits: KeyLimits, use: WindowUse) -> None:
        self.limits, self.use = limits, use
        self.tokens, self.cost = use.tokens, use.cost

    def admit(self, tokens: int, cost: float) -> bool:
        if (self.limits.tokens_per_minute is not None
                and self.tokens >= self.limits.tokens_per_minute) \
                or (self.limits.cost_per_day is not None and self.cost >= self.limits.cost_per_day):
            return False  # and, in claim order, no later run jumps the queue
        self.tokens += tokens
        self.cost += cost
        return True


def entries_for(key: str, started: list[AgentRun], reserved: dict[int, tuple[int, float]],
                at: datetime) -> list[KeyWindowEntry]:
    return [KeyWindowEntry(key=key, run_id=r.pk, attempt=r.attempt, started_at=at,
                           reserved_tokens=reserved[r.pk][0], reserved_cost=reserved[r.pk][1])
            for r in started]


def write_entries(entries: list[KeyWindowEntry]) -> None:
    if entries:
        KeyWindowEntry.objects.bulk_create(entries)


def add_usage(run_id: int, attempt: int, tokens: int, cost: float) -> None:
    """An attempt's recorded usage, into its window entry (none: its key has no window)."""
    KeyWindowEntry.objects.filter(run_id=run_id, attempt=attempt).update(
        used_tokens=F("used_tokens") + tokens, used_cost=F("used_cost") + cost)


@dataclass(frozen=True)
class FullWindow:
    """A window without room: which, what it holds, and when it has room at the earliest."""

    window: str
    text: str
    room_at: datetime | None


def full_window(limits: KeyLimits, use: WindowUse, at: datetime) -> FullWindow | None:
    """The first of the key's windows with no room at `at`, if any."""
    minute_room = None if use.oldest_minute is None \
        else use.oldest_minute + timedelta(seconds=MINUTE)
    if limits.per_minute is not None and use.starts >= limits.per_minute:
        return FullWindow("per_minute", f"{use.starts} runs started in the last minute, "
                          f"its per_minute is {limits.per_minute}", minute_room)
    if limits.tokens_per_minute is not None and use.tokens >= limits.tokens_per_minute:
        return FullWindow("tokens_per_minute", f"{use.tokens:,.0f} tokens in the last minute, "
                          f"its tokens_per_minute is {limits.tokens_per_minute:,}", minute_room)
    if limits.cost_per_day is not None and use.cost >= limits.cost_per_day:
        day_room = None if use.oldest_day is None else use.oldest_day + timedelta(seconds=DAY)
        return FullWindow("cost_per_day", f"{use.cost:.4g} spent in the last day, its "
                          f"cost_per_day is {limits.cost_per_day:g}", day_room)
    return None


def carry_entries(reclaimed: list[AgentRun], at: datetime) -> None:
    """A reclaimed run's new attempt reserves what its lost one did (only runs of windowed
    keys have entries); the lost attempt's then counts only what it used."""
    if not reclaimed:
        return
    lost = Q()
    for run in reclaimed:
        lost |= Q(run_id=run.pk, attempt=run.attempt - 1)
    attempt = {r.pk: r.attempt for r in reclaimed}
    write_entries([KeyWindowEntry(key=e.key, run_id=e.run_id, attempt=attempt[e.run_id],
                                  started_at=at, reserved_tokens=e.reserved_tokens,
                                  reserved_cost=e.reserved_cost)
                   for e in KeyWindowEntry.objects.filter(lost)])


def windowed_keys(rows: list[dict[str, Any]] | None = None) -> dict[str, KeyLimits]:
    """Every key with a limits row and a window, with its limits in force (the small
    limits table, or its `rows` as read with FIELDS, and the setting)."""
    if rows is None:
        rows = list(AgentLimit.objects.values("key", *FIELDS))
    patterns = {r["key"]: row_limits(r) for r in rows if is_pattern(r["key"])}
    table = settings_table()
    limits = {r["key"]: resolve(r["key"], row_limits(r), patterns, table) for r in rows
              if not is_pattern(r["key"])}
    return {k: v for k, v in limits.items() if v.windowed}


def full_window_keys(at: datetime) -> list[str]:
    """Keys with a window without room at `at`: no worker starts their runs until it has
    (so a burst worker does not wait for them)."""
    windowed = windowed_keys()
    uses = window_use(windowed, at)
    return sorted(k for k, v in windowed.items()
                  if full_window(v, uses.get(k, WindowUse()), at) is not None)


def window_fill(at: datetime, rows: list[dict[str, Any]] | None = None
                ) -> dict[tuple[str, str], float]:
    """How full each window of each windowed key is at `at` (1.0: full), for the gauge;
    no query beyond `rows` (the limits table) without a windowed key."""
    windowed = windowed_keys(rows)
    uses = window_use(windowed, at)
    fill: dict[tuple[str, str], float] = {}
    for key, limits in windowed.items():
        use = uses.get(key, WindowUse())
        for window, size, held in (("per_minute", limits.per_minute, use.starts),
                                   ("tokens_per_minute", limits.tokens_per_minute, use.tokens),
                                   ("cost_per_day", limits.cost_per_day, use.cost)):
            if size is not None:
                fill[(key, window)] = held / size if size else 1.0
    return fill


def give_pattern_keys_rows(keys: Iterable[str], at: datetime | None = None) -> None:
    """A row for each key that a limits pattern ("tenant:*", in the table or the setting)
    matches, so that its runs go through the limited claim with their own windows."""
    keys = {k for k in keys if k and not is_pattern(k)}
    if not keys:
        return
    patterns = set(AgentLimit.objects.filter(key__endswith="*").values_list("key", flat=True))
    patterns |= {k for k in settings_table() if is_pattern(k)}
    matched = [k for k in sorted(keys) if best_pattern(k, patterns)]
    if matched:
        AgentLimit.objects.bulk_create([AgentLimit(key=k, updated_at=at or timezone.now())
                                        for k in matched], ignore_conflicts=True)
