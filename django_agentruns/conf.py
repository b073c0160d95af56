"""The app's settings: one object, read lazily from `settings.AGENTRUNS`.

Lazy so that `override_settings(AGENTRUNS=...)` in tests takes effect at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

SETTING_NAME = "AGENTRUNS"

VERSION = "0.1.0"
"""pyproject.toml's version: `django_agentruns.__version__`, and each worker's record."""


@dataclass(frozen=True)
class Defaults:
    """Every setting with its default; docs/settings.md's table mirrors this."""

    LEASE_TTL: float = 60.0
    """Seconds a claim's lease lasts without renewal; a dead worker's run is reclaimed after it."""
    MAX_REQUEUES: int = 3
    """Requeues a run may take, failure retries and stale reclaims together (per agent too)."""
    BACKOFF_BASE: float = 2.0
    """Seconds before the first retry; doubles with each requeue."""
    BACKOFF_CAP: float = 300.0
    """Longest backoff in seconds, before jitter."""
    BACKOFF_JITTER: float = 0.25
    """Fraction of the delay removed at random, so retries of a burst spread out."""
    POLL_INTERVAL: float = 1.0
    """Seconds an idle worker waits before looking for due runs again."""
    REAP_INTERVAL: float = 30.0
    """Seconds between a worker's own reaps of lapsed leases; 0 turns them off."""
    GRACE: float = 5.0
    """Seconds running attempts get to finish after SIGTERM before they are stopped and
    recorded as interrupted (requeued without spending the budget)."""
    DEFAULT_QUEUE: str = "default"
    """Queue of agents that name none."""
    CLASSIFIER: str | None = None
    """Dotted path of `f(exc) -> bool | None`: True retryable, False not, None undecided."""
    UNKNOWN_ERRORS_RETRYABLE: bool = True
    """Whether an error nothing recognises is retried (within the budget) or dead-lettered."""
    CLAIM_BATCH: int = 64
    """Most runs one claim statement takes, however many slots are free. Only a worker with
    more free slots than this feels it: its refills after a wave of finishes take fewer,
    cheaper statements (docs/performance.md, "Claim batch")."""
    PREPARED_STATEMENTS: bool = False
    """PostgreSQL: have the server plan the enqueue, claim and settle statements once per
    connection, and on a direct connection the attempt store's one-statement writes too,
    the worker's connections planning by index (`transitions.plans`). Off by default, as
    Django's own `prepare_threshold` is: a pooler in transaction mode without
    prepared-statement support (PgBouncer before 1.21) breaks them."""
    STREAMS_PER_USER: int = 4
    """Event streams (`runs/<id>/events/`) one user may have open in one web process; past
    it the answer is 429 with Retry-After."""
    STREAMS_PER_PROCESS: int = 50
    """Event streams one web process serves at once (each holds a server thread under WSGI:
    keep it below the process's threads); past it, 429 with Retry-After."""
    STREAM_ACCESS: str | None = None
    """Dotted path of `f(request, run) -> bool`: True lets the request watch that run's
    event stream and live output without `view_agentrun` (the app's own rule, e.g. the
    run belongs to the user). None: permissions and signed links (`stream_url`) only."""
    WAITERS_PER_PROCESS: int = 1000
    """Callers of `wait_for_run` / `await_run` waiting at once in one process (they share
    one LISTEN connection on PostgreSQL); past it the call raises `TooManyWaitersError`."""
    WRITER_CONNECTIONS: int = 2
    """Connections (and threads) of a worker's attempt store, which commits every write its
    attempts make (events, checkpoints, renewals, successes) in group commits."""
    MAX_INPUT_BYTES: int = 1_048_576
    """Largest run input, as JSON text (1 MiB); `enqueue` refuses a larger one."""
    MAX_OUTPUT_BYTES: int = 1_048_576
    """Largest output an agent may return, as JSON text; past it the run is dead-lettered
    `not_retryable`, before anything is written."""
    MAX_STATE_BYTES: int = 1_048_576
    """Largest checkpoint state, as JSON text; `ctx.checkpoint` refuses a larger one."""
    MAX_EVENT_BYTES: int = 262_144
    """Largest event payload, as JSON text (256 KiB); `ctx.emit` refuses a larger one."""
    MAX_EVENTS_PER_RUN: int = 10_000
    """Events an attempt may add to its run's stream (emits and checkpoint markers); past
    it `ctx.emit` raises. The run's own transitions are always recorded."""
    MAX_STEPS_PER_RUN: int = 10_000
    """Durable steps (`ctx.step`) a run may record; past it `ctx.step` raises
    `LimitExceeded`, naming the step."""
    MAX_SPAWN_DEPTH: int = 10
    """Deepest tree of child runs: a run `MAX_SPAWN_DEPTH` levels below its root cannot
    `ctx.spawn` (LimitExceeded, which dead-letters it unless the agent catches it), so an
    agent that spawns itself cannot grow without end."""
    MAX_CHILDREN_PER_RUN: int = 1000
    """Most child runs one run may spawn (over all its attempts); past it `ctx.spawn`
    raises LimitExceeded."""
    MAX_DELIVERIES_PER_RUN: int = 1000
    """Most payloads `deliver` may store for keys a run does not wait for yet (unread
    deliveries); past it `deliver` raises LimitExceeded. A delivery that answers the
    run's current wait is always taken."""
    CHECKPOINT_HISTORY: int | None = 20
    """Checkpoint states kept per run (the latest ones, what `fork` and the admin's "fork
    from here" start from); older ones are deleted as new ones are saved. None keeps all."""
    READ_DATABASE: str | None = None
    """Alias of the `DATABASES` entry (a streaming replica) that the admin's lists and
    overview, `why`, the metrics gauges and the event streams' catch-up reads use; None:
    `default`. Every action writes to, and re-checks the run on, the primary."""
    LISTEN_DATABASE: str | None = None
    """Alias of the `DATABASES` entry the worker's LISTEN connection uses, one that reaches
    PostgreSQL directly, not through a transaction pooler (PgBouncer in transaction mode
    loses notifications); None: the worker's own (`default`). Only the listener uses it."""
    SCHEDULE_MAX_CATCH_UP: int = 100
    """Most missed ticks a `catch_up=True` schedule runs after an outage (the latest ones);
    the older ones are skipped with a warning, so a long outage cannot flood the queue."""
    MAX_SNOOZES: int = 20
    """Snoozes a run gets without spending its requeue budget (`Snooze`, or a 429/503 with
    Retry-After); past them a snooze counts as an ordinary retry, so a run cannot wait
    forever."""
    LIMITS: dict[str, Any] | None = None
    """Most runs of a limit key running at once across all workers, e.g. {"openai": 20}.
    `set_limit(key, n)` (or the admin) overrides a key at run time; keys in neither are
    unlimited."""
    MODEL_PRICES: dict[str, dict[str, float]] | None = None
    """Prices per million tokens by model, e.g. {"gpt-4o-mini": {"input": 0.15, "output":
    0.6}} (a key ending in `*` is a prefix): `record_usage` prices a call given no cost, and
    the framework integrations use it before their framework's own price list."""
    FAIR_WEIGHTS: dict[str, float] | None = None
    """Weights of fairness groups (`fair_key`), e.g. {"tenant:big": 3}: within a queue, a
    group with due runs gets starts in proportion to its weight; a group not listed weighs
    1. Weights apply at enqueue: a change reaches runs enqueued after it."""
    METRICS_TOKEN: str | None = None
    """Bearer token that may read `metrics/` of `django_agentruns.urls` without logging in
    (for a Prometheus scraper); None: only users with `view_agentrun` may."""
    HISTORY_PARTITION: int | None = None
    """PostgreSQL: run ids per partition of the history tables (events, checkpoints, waits,
    steps, usage, chunks), e.g. 1_000_000; old history then goes by dropping partitions
    (docs/history.md). None: plain tables. Read by migrate; SQLite ignores it."""


# Read on every setting lookup, some of them per run: built once.
_NAMES = frozenset(f.name for f in fields(Defaults))


class AppSettings:
    """Attribute access to `settings.AGENTRUNS` with the defaults above filled in."""

    def __getattr__(self, name: str) -> Any:
        if name not in _NAMES:
            raise AttributeError(f"Unknown django-agentruns setting {name!r}")
        user: dict[str, Any] = getattr(settings, SETTING_NAME, {}) or {}
        return user.get(name, getattr(Defaults, name))

    @staticmethod
    def known() -> set[str]:
        return set(_NAMES)

    def classifier(self) -> Callable[[BaseException], bool | None] | None:
        path = self.CLASSIFIER
        return import_string(path) if path else None


app_settings = AppSettings()
