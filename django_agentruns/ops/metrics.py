"""Prometheus metrics, with the optional `prometheus` extra (prometheus_client).

Two kinds:

* observed by the process that settles attempts (the worker): a counter of attempts by
  agent and outcome, and histograms of queue wait and attempt duration
  (`observe_settlement`);
* read from the database when scraped (`backlog.read_backlog`): the backlog per queue
  and the dead letters (`BacklogCollector`), at most once per `BACKLOG_TTL` seconds
  whoever scrapes, with grouped COUNTs the partial due index, the running index and the
  status+reason index answer, never a count of the whole table; and the due runs of
  agents this process does not have (the runs its workers leave queued), one grouped
  COUNT over the queued runs; also the paused queues and the closed limit keys.

Served by `runworker --metrics-port` (`serve`) and, for the web process, by `metrics_view`
(`django_agentruns.urls`). Without prometheus_client everything here imports, the observe
calls do nothing, `serve` raises `MetricsUnavailable` and the view answers 501.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from ..conf import app_settings
from ..db import read_alias
from ..exceptions import AgentRunsError
from ..states import DEAD_LETTER_REASONS
from .backlog import Backlog as Backlog  # re-exported: metrics.Backlog, metrics.read_backlog
from .backlog import read_backlog as read_backlog

try:
    import prometheus_client
    from prometheus_client.core import GaugeMetricFamily, Metric
except ImportError:  # the `prometheus` extra is not installed: everything below is a no-op
    prometheus_client = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ..models import AgentRun

logger = logging.getLogger("django_agentruns.metrics")

AVAILABLE = prometheus_client is not None
"""Whether prometheus_client is importable (the `prometheus` extra)."""

INSTALL_HINT = "pip install 'django-agentruns[prometheus]'"

DEFAULT_ADDR = "127.0.0.1"
"""Where `serve` (`runworker --metrics-port`) listens unless told: loopback only, since the
server answers anyone who can reach it."""

BACKLOG_TTL = 15.0
"""Seconds a backlog reading is served from cache: N scrapers cost one reading per TTL."""

VIEW_PERMISSION = "django_agentruns.view_agentrun"

# Agent work takes seconds to hours; a queue wait is milliseconds when workers keep up.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                    1800.0, 3600.0)
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                300.0, 900.0, 3600.0)


class MetricsUnavailable(AgentRunsError):
    """Metrics were asked for, but prometheus_client is not installed."""


if prometheus_client is not None:
    ATTEMPTS = prometheus_client.Counter(
        "agentruns_attempts",
        "Attempts settled, by agent and outcome (succeeded, requeued, dead_lettered, "
        "cancelled, lost). Each run ends in exactly one succeeded, dead_lettered or cancelled.",
        ("agent", "outcome"))
    QUEUE_WAIT = prometheus_client.Histogram(
        "agentruns_queue_wait_seconds",
        "Seconds from a run being due (enqueued, or its retry backoff over) to an attempt "
        "starting.", ("agent",), buckets=WAIT_BUCKETS)
    DURATION = prometheus_client.Histogram(
        "agentruns_attempt_duration_seconds",
        "Seconds an attempt took, from its start to its settlement, by agent and outcome.",
        ("agent", "outcome"), buckets=DURATION_BUCKETS)
    TOKENS = prometheus_client.Counter(
        "agentruns_tokens",
        "Tokens (input and output) agents recorded with ctx.record_usage, by agent and model.",
        ("agent", "model"))
    COST = prometheus_client.Counter(
        "agentruns_cost",
        "Cost agents recorded with ctx.record_usage (in the callers' unit), by agent and "
        "model.", ("agent", "model"))
    STEPS = prometheus_client.Counter(
        "agentruns_steps",
        "Durable steps (ctx.step) by agent and outcome: done (executed and stored), "
        "replayed (its stored result returned, not executed), failed (an execution raised).",
        ("agent", "outcome"))
    WAKEUPS_DEGRADED = prometheus_client.Gauge(
        "agentruns_wakeups_degraded",
        "1 while this worker's LISTEN connection is down or failed its self-check (a "
        "transaction pooler in the way: set LISTEN_DATABASE), so new runs wait for the next "
        "poll; 0 while NOTIFY wakes it.")


def observe_settlement(
    agent: str, outcome: str, queue_wait_s: float | None, duration_s: float | None
) -> None:
    """Count one settled attempt; `outcome` is a `transitions.Settlement` value.

    A None wait or duration is not observed (an interactive run waited in no queue).
    """
    if prometheus_client is None:
        return
    # The labelled children are kept, as for steps: three `labels()` a run cost more
    # than the observations.
    children = _settlement_children.get((agent, outcome))
    if children is None:
        children = _settlement_children[agent, outcome] = (
            ATTEMPTS.labels(agent, outcome), QUEUE_WAIT.labels(agent),
            DURATION.labels(agent, outcome))
    children[0].inc()
    if queue_wait_s is not None:
        children[1].observe(max(0.0, queue_wait_s))
    if duration_s is not None:
        children[2].observe(max(0.0, duration_s))


_settlement_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}


def observe_usage(agent: str, model: str, tokens: int, cost: float) -> None:
    """Count one `ctx.record_usage` (agentruns_tokens_total, agentruns_cost_total)."""
    if prometheus_client is None:
        return
    TOKENS.labels(agent, model).inc(tokens)
    COST.labels(agent, model).inc(cost)


def observe_step(agent: str, outcome: str) -> None:
    """Count one step's end (agentruns_steps_total): done, replayed or failed. The labelled
    counters are kept: `labels()` costs more than the step's other bookkeeping."""
    if prometheus_client is None:
        return
    counter = _step_counters.get((agent, outcome))
    if counter is None:
        counter = _step_counters[agent, outcome] = STEPS.labels(agent, outcome)
    counter.inc()


_step_counters: dict[tuple[str, str], Any] = {}


def set_wakeups_degraded(degraded: bool) -> None:
    """Record whether this worker is woken by NOTIFY (0) or left to polling (1)."""
    if prometheus_client is not None:
        WAKEUPS_DEGRADED.set(1 if degraded else 0)


def queue_wait(run: AgentRun) -> float | None:
    """Seconds `run` (as claimed) waited between being due and this attempt's start."""
    if run.started_at is None or run.available_at is None:
        return None
    return max(0.0, (run.started_at - run.available_at).total_seconds())


# --------------------------------------------------------------------------- backlog gauges


class BacklogCollector:
    """A prometheus_client collector of the backlog gauges, read through a cache.

    Queues seen once (or served by a registered agent) keep reporting 0 when they drain,
    rather than vanishing: a series that disappears cannot fire "below" alerts.
    If the database cannot be read, the last reading is served (and the error logged).
    """

    def __init__(
        self, ttl: float | None = None, clock: Callable[[], float] = time.monotonic,
        read: Callable[[], Backlog] = read_backlog,
    ) -> None:
        self.ttl = BACKLOG_TTL if ttl is None else ttl
        self._clock = clock
        self._read = read
        self._lock = threading.Lock()
        self._cached: Backlog | None = None
        self._read_at = 0.0
        self._queues: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        # Declared, so registering the collector does not read the database.
        return list(self._families(Backlog(), set()))

    def collect(self) -> Iterable[Metric]:
        backlog = self.reading()
        if backlog is None:
            return []
        queues = (self._queues | set(backlog.due) | set(backlog.blocked) | set(backlog.scheduled)
                  | set(backlog.running) | set(backlog.waiting) | set(backlog.paused))
        self._queues = queues
        return list(self._families(backlog, queues | _agent_queues()))

    def reading(self) -> Backlog | None:
        """The cached reading, refreshed first if it is older than the TTL."""
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._read_at < self.ttl:
                return self._cached
            try:
                with _closing_if_opened():
                    self._cached = self._read()
                self._read_at = now
            except DatabaseError:
                logger.exception("could not read the run backlog for the metrics")
            return self._cached

    def clear(self) -> None:
        """Forget the cached reading: the next scrape reads the database."""
        with self._lock:
            self._cached = None

    @staticmethod
    def _families(backlog: Backlog, queues: set[str]) -> Iterator[Metric]:
        gauges = (
            ("agentruns_queue_depth", "Queued runs due now that may start, by queue.",
             backlog.due),
            ("agentruns_queue_blocked", "Queued runs due now but held back by an earlier run "
             "of their scope (ordered agents), by queue.", backlog.blocked),
            ("agentruns_queue_scheduled", "Queued runs not due yet (backoff or run_after), "
             "by queue.", backlog.scheduled),
            ("agentruns_queue_oldest_due_seconds", "Seconds the longest-waiting due run of "
             "the queue that may start has been due (0 when none is).", backlog.oldest_due),
            ("agentruns_running", "Runs with an attempt in progress, by queue.",
             backlog.running),
            ("agentruns_leases_lapsed", "Running runs whose lease lapsed and that nobody "
             "has taken back yet, by queue.", backlog.lapsed),
            ("agentruns_waiting", "Runs waiting for a delivery, an approval or their child "
             "runs (no lease, no worker slot), by queue.", backlog.waiting),
            ("agentruns_queue_paused", "1 while the queue is paused (workers claim nothing "
             "from it), else 0.", backlog.paused),
        )
        for name, doc, values in gauges:
            family = GaugeMetricFamily(name, doc, labels=["queue"])
            for queue in sorted(queues):
                family.add_metric([queue], values.get(queue, 0))
            yield family
        dead = GaugeMetricFamily("agentruns_dead_letters",
                                 "Dead-lettered runs (failed for good), by reason.",
                                 labels=["reason"])
        for reason in DEAD_LETTER_REASONS:
            dead.add_metric([str(reason)], backlog.dead_letters.get(reason, 0))
        yield dead
        unknown = GaugeMetricFamily(
            "agentruns_unknown_agent_runs",
            "Due runs of agents not registered in this process, by queue and agent: its "
            "workers leave them queued for a worker that has the agent (present while > 0).",
            labels=["queue", "agent"])
        for (queue, agent), count in sorted(backlog.unknown_agents.items()):
            unknown.add_metric([queue, agent], count)
        yield unknown
        closed = GaugeMetricFamily(
            "agentruns_limit_closed_seconds",
            "Seconds until a limit key closed by a 429 reopens, by key (present while closed):"
            " no worker starts a run of it meanwhile.", labels=["key"])
        for key, seconds in sorted(backlog.closed_keys.items()):
            closed.add_metric([key], seconds)
        yield closed
        fill = GaugeMetricFamily(
            "agentruns_limit_window_fill",
            "How full each window of a limit key is, by key and window (per_minute, "
            "tokens_per_minute, cost_per_day): at 1 no run of the key starts.",
            labels=["key", "window"])
        for (key, window), ratio in sorted(backlog.window_fill.items()):
            fill.add_metric([key, window], ratio)
        yield fill


def _agent_queues() -> set[str]:
    from ..registry import all_agents

    return {spec.effective_queue() for spec in all_agents().values()}


@contextmanager
def _closing_if_opened() -> Iterator[None]:
    """Close the connection afterwards if this call opened it.

    The exporter of `runworker --metrics-port` answers each scrape on a new thread, and a
    connection a finished thread leaves open is never reused or closed. A request thread
    (the view) keeps its connection, and so does one inside a transaction.
    """
    # The gauges read from READ_DATABASE (a replica) when set; a few reads may use `default`.
    conns = [connections[alias] for alias in {DEFAULT_DB_ALIAS, read_alias()}]
    opened = [conn for conn in conns if conn.connection is None]
    try:
        yield
    finally:
        for conn in opened:
            if not conn.in_atomic_block:
                conn.close()


_registered: BacklogCollector | None = None
_register_lock = threading.Lock()


def register_backlog() -> BacklogCollector | None:
    """Register the backlog collector with prometheus_client's default registry, once."""
    global _registered
    if prometheus_client is None:
        return None
    with _register_lock:
        if _registered is None:
            _registered = BacklogCollector()
            prometheus_client.REGISTRY.register(_registered)
    return _registered


# --------------------------------------------------------------------------- exposition


def serve(port: int, addr: str = DEFAULT_ADDR) -> tuple[str, int]:
    """Serve the default registry over HTTP from a daemon thread; return (host, port).

    Port 0 picks a free port (the returned one). Raises `MetricsUnavailable` without
    prometheus_client, OSError if the port cannot be bound.
    """
    if prometheus_client is None:
        raise MetricsUnavailable(f"metrics need prometheus_client: {INSTALL_HINT}")
    register_backlog()
    server, _thread = prometheus_client.start_http_server(port, addr)
    host, bound = server.server_address[:2]
    logger.info("serving metrics on http://%s:%s/metrics", host, bound)
    return str(host), int(bound)


def _authorized(request: HttpRequest) -> HttpResponse | None:
    """None if the request may read the metrics, else the response that says why not."""
    token = app_settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if token and header.startswith("Bearer ") and hmac.compare_digest(
            header.removeprefix("Bearer ").strip().encode(), str(token).encode()):
        return None
    user: Any = getattr(request, "user", None)
    if user is not None and user.is_authenticated and not header:
        if user.has_perm(VIEW_PERMISSION):
            return None
        return HttpResponse("You may not view agent runs.\n", status=403,
                            content_type="text/plain")
    response = HttpResponse("Log in with permission to view agent runs, or send "
                            "Authorization: Bearer <AGENTRUNS['METRICS_TOKEN']>.\n",
                            status=401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="agentruns metrics"'
    return response


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics of this process, and the backlog gauges, in Prometheus text format.

    Allowed to a logged-in user with `view_agentrun`, or to a bearer of
    `AGENTRUNS["METRICS_TOKEN"]` (a scraper).
    """
    refused = _authorized(request)
    if refused is not None:
        return refused
    if prometheus_client is None:
        return HttpResponse(f"Metrics need prometheus_client: {INSTALL_HINT}\n", status=501,
                            content_type="text/plain")
    register_backlog()
    output = prometheus_client.generate_latest(prometheus_client.REGISTRY)
    return HttpResponse(output, content_type=prometheus_client.CONTENT_TYPE_LATEST)
