"""System checks for the AGENTRUNS setting, with stable ids (agentruns.E00x / W00x)."""

from __future__ import annotations

import math
import re
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.utils.module_loading import import_string

from .conf import SETTING_NAME, AppSettings, Defaults
from .ops.probes import (  # noqa: F401 (registered here; ids and checks re-exported)
    E020_BAD_HISTORY_PARTITION,
    W009_PINNED_VERSIONS,
    W020_HISTORY_LAYOUT,
    check_history_layout,
    check_history_partition,
    check_pinned_versions,
)
from .registry import QUEUE_RULE, is_queue_name
from .rules.fairness import weight_problem
from .rules.pricing import problem as price_problem
from .rules.windows import settings_problem as limits_problem
from .sqlite import SQLITE_OPTIONS

E001_NOT_A_DICT = "agentruns.E001"
E002_UNKNOWN_SETTING = "agentruns.E002"
E003_BAD_NUMBER = "agentruns.E003"
E004_BAD_CLASSIFIER = "agentruns.E004"
E005_BAD_QUEUE = "agentruns.E005"
E006_BACKOFF_ORDER = "agentruns.E006"
E007_BAD_METRICS_TOKEN = "agentruns.E007"
E009_NOT_A_FLAG = "agentruns.E009"
E011_BAD_LIMITS = "agentruns.E011"
E015_BAD_STREAM_ACCESS = "agentruns.E015"
E016_BAD_MODEL_PRICES = "agentruns.E016"
E017_BAD_FAIR_WEIGHTS = "agentruns.E017"
W001_SQLITE_DEFERRED = "agentruns.W001"
W002_SQLITE_NOT_WAL = "agentruns.W002"
W003_SHORT_LEASE = "agentruns.W003"
W004_RECONNECT_PER_RUN = "agentruns.W004"
W008_CONNECTIONS = "agentruns.W008"

SHORTEST_SENSIBLE_LEASE = 1.0
# Both SQLite warnings give the one fix, with the values SQLITE_OPTIONS and the guides use.
SQLITE_HINT = ("from django_agentruns.sqlite import SQLITE_OPTIONS, then "
               "DATABASES['default']['OPTIONS'] = {**SQLITE_OPTIONS}, that is "
               f"{SQLITE_OPTIONS!r} (journal_mode=WAL: readers run while a worker writes)")

# Upper bounds: a longer duration overflows the datetime arithmetic (a lease of 1e12 s ends
# after the year 9999) or a thread's wait (POLL_INTERVAL); a larger requeue budget does not
# fit AgentRun.max_requeues, an integer column.
LONGEST_DURATION = 365 * 24 * 3600
LARGEST_COUNT = 2**31 - 1
# The size caps stay well under PostgreSQL's 255 MB for one jsonb value (whose binary form
# may be larger than its text), with room for the batches that carry several values.
LARGEST_SIZE = 64 * 1024 * 1024

_POSITIVE = ("LEASE_TTL", "POLL_INTERVAL")
_NON_NEGATIVE = ("BACKOFF_BASE", "BACKOFF_CAP", "REAP_INTERVAL", "GRACE")
_INTEGERS = ("MAX_REQUEUES", "CLAIM_BATCH", "STREAMS_PER_USER", "STREAMS_PER_PROCESS",
             "WRITER_CONNECTIONS", "MAX_SNOOZES", "WAITERS_PER_PROCESS")
_AT_LEAST_ONE = ("CLAIM_BATCH", "STREAMS_PER_USER", "STREAMS_PER_PROCESS", "WRITER_CONNECTIONS",
                 "WAITERS_PER_PROCESS")
_SIZES = ("MAX_INPUT_BYTES", "MAX_OUTPUT_BYTES", "MAX_STATE_BYTES", "MAX_EVENT_BYTES")
_CAPS = (*_SIZES, "MAX_EVENTS_PER_RUN", "SCHEDULE_MAX_CATCH_UP", "MAX_STEPS_PER_RUN",
         "MAX_SPAWN_DEPTH", "MAX_CHILDREN_PER_RUN", "MAX_DELIVERIES_PER_RUN",
         "CHECKPOINT_HISTORY")
_NONE_ALLOWED = ("CHECKPOINT_HISTORY",)  # None: no cap
_FLAGS = ("UNKNOWN_ERRORS_RETRYABLE", "PREPARED_STATEMENTS")


def _callable_problems(raw: dict[str, Any], key: str, check_id: str,
                       hint: str) -> list[CheckMessage]:
    """A setting that names a callable by its dotted path must import as one."""
    path = raw.get(key)
    if path is None:
        return []
    try:
        if not isinstance(path, str):
            raise TypeError("not a dotted path")
        if not callable(import_string(path)):
            raise TypeError("not callable")
    except (ImportError, TypeError, ValueError) as exc:
        return [Error(f"{SETTING_NAME}[{key!r}] = {path!r} cannot be imported as a "
                      f"callable: {exc}.", hint=hint, id=check_id)]
    return []


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    raw = getattr(settings, SETTING_NAME, {})
    if raw is None:
        return []
    if not isinstance(raw, dict):
        return [Error(f"{SETTING_NAME} must be a dict, not {type(raw).__name__}.",
                      hint="AGENTRUNS = {'LEASE_TTL': 60, ...}", id=E001_NOT_A_DICT)]
    errors: list[CheckMessage] = []
    for key in sorted(set(raw) - AppSettings.known(), key=repr):  # keys of any type
        errors.append(Error(f"{SETTING_NAME}[{key!r}] is not a setting of django-agentruns.",
                            hint=f"Known settings: {', '.join(sorted(AppSettings.known()))}.",
                            id=E002_UNKNOWN_SETTING))
    for key in _POSITIVE + _NON_NEGATIVE + _INTEGERS + _CAPS + ("BACKOFF_JITTER",):
        if key in raw and not (key in _NONE_ALLOWED and raw[key] is None):
            problem = _number_problem(key, raw[key])
            if problem:
                errors.append(Error(f"{SETTING_NAME}[{key!r}] {problem}, not {raw[key]!r}.",
                                    hint=f"The default is {getattr(Defaults, key)!r}.",
                                    id=E003_BAD_NUMBER))
    for key in _FLAGS:
        if key in raw and not isinstance(raw[key], bool):
            errors.append(Error(f"{SETTING_NAME}[{key!r}] must be True or False, not "
                                f"{raw[key]!r}.",
                                hint=f"The default is {getattr(Defaults, key)!r}.",
                                id=E009_NOT_A_FLAG))
    classifier = raw.get("CLASSIFIER")
    if classifier is not None:
        try:
            if not isinstance(classifier, str):
                raise TypeError("not a dotted path")
            if not callable(import_string(classifier)):
                raise TypeError("not callable")
        except (ImportError, TypeError, ValueError) as exc:
            errors.append(Error(f"{SETTING_NAME}['CLASSIFIER'] = {classifier!r} cannot be "
                                f"imported as a callable: {exc}.",
                                hint="A dotted path to f(exc) -> True | False | None.",
                                id=E004_BAD_CLASSIFIER))
    errors += _callable_problems(raw, "STREAM_ACCESS", E015_BAD_STREAM_ACCESS,
                                 "A dotted path to f(request, run) -> bool, or None.")
    queue = raw.get("DEFAULT_QUEUE", Defaults.DEFAULT_QUEUE)
    if not is_queue_name(queue):
        errors.append(Error(f"{SETTING_NAME}['DEFAULT_QUEUE'] must be {QUEUE_RULE}, not "
                            f"{queue!r}.",
                            hint=f"The default is {Defaults.DEFAULT_QUEUE!r}.", id=E005_BAD_QUEUE))
    ttl = raw.get("LEASE_TTL", Defaults.LEASE_TTL)
    if _number_problem("LEASE_TTL", ttl) is None and ttl < SHORTEST_SENSIBLE_LEASE:
        errors.append(Warning(
            f"{SETTING_NAME}['LEASE_TTL'] is {ttl} s: workers renew every third of it, and a "
            "pause longer than that (a slow commit, a GC pause) loses the run to another "
            "worker.", hint=f"Use at least {SHORTEST_SENSIBLE_LEASE} s; the default is "
            f"{Defaults.LEASE_TTL} s.", id=W003_SHORT_LEASE))
    token = raw.get("METRICS_TOKEN")
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        # The value is a secret: the message says what it is like, never what it is.
        given = f"a {len(token)}-character string" if isinstance(token, str) else \
            f"a value of type {type(token).__name__}"
        errors.append(Error(f"{SETTING_NAME}['METRICS_TOKEN'] must be None or a string of at "
                            f"least 16 characters, not {given}.",
                            hint="A long random secret, e.g. from `python -c 'import secrets; "
                                 "print(secrets.token_urlsafe(32))'`, read from the "
                                 "environment.", id=E007_BAD_METRICS_TOKEN))
    errors += _limits_errors(raw.get("LIMITS"))
    errors += _prices_errors(raw.get("MODEL_PRICES"))
    errors += _fair_weights_errors(raw.get("FAIR_WEIGHTS"))
    base, cap = raw.get("BACKOFF_BASE", Defaults.BACKOFF_BASE), raw.get(
        "BACKOFF_CAP", Defaults.BACKOFF_CAP)
    # Compared only when both are valid numbers: a bad one already has its E003.
    if _number_problem("BACKOFF_BASE", base) is None and \
            _number_problem("BACKOFF_CAP", cap) is None and cap < base:
        errors.append(Error(f"{SETTING_NAME}: BACKOFF_CAP ({cap}) is below BACKOFF_BASE "
                            f"({base}).", hint="BACKOFF_CAP is the longest backoff; make it "
                            "at least BACKOFF_BASE, the first.", id=E006_BACKOFF_ORDER))
    return errors


def _limits_errors(limits: Any) -> list[CheckMessage]:
    """LIMITS: a dict of limit key -> most runs of it running at once (>= 0)."""
    if limits is None:
        return []
    hint = 'LIMITS = {"openai": 20, "tenant:42": 2}: keys as in @agent(limit_key=...).'
    if not isinstance(limits, dict):
        return [Error(f"{SETTING_NAME}['LIMITS'] must be a dict, not "
                      f"{type(limits).__name__}.", hint=hint, id=E011_BAD_LIMITS)]
    errors: list[CheckMessage] = []
    for key, value in limits.items():
        problem = limits_problem(key, value)
        if problem:
            errors.append(Error(f"{SETTING_NAME}['LIMITS'][{key!r}]: {problem}.", hint=hint,
                                id=E011_BAD_LIMITS))
    return errors


def _prices_errors(prices: Any) -> list[CheckMessage]:
    """MODEL_PRICES: a dict of model name (or prefix*) -> {"input": X, "output": Y}."""
    if prices is None:
        return []
    hint = ('MODEL_PRICES = {"gpt-4o-mini": {"input": 0.15, "output": 0.6}}: per million '
            'tokens, by the model name the provider reports (a key ending in * is a prefix).')
    if not isinstance(prices, dict):
        return [Error(f"{SETTING_NAME}['MODEL_PRICES'] must be a dict, not "
                      f"{type(prices).__name__}.", hint=hint, id=E016_BAD_MODEL_PRICES)]
    return [Error(f"{SETTING_NAME}['MODEL_PRICES'][{key!r:.60}]: {problem}.", hint=hint,
                  id=E016_BAD_MODEL_PRICES)
            for key, value in prices.items() if (problem := price_problem(key, value))]
def _fair_weights_errors(weights: Any) -> list[CheckMessage]:
    """FAIR_WEIGHTS: a dict of fairness group -> weight (a number above 0)."""
    if weights is None:
        return []
    hint = 'FAIR_WEIGHTS = {"tenant:big": 3}: groups as in @agent(fair_key=...), default 1.'
    if not isinstance(weights, dict):
        return [Error(f"{SETTING_NAME}['FAIR_WEIGHTS'] must be a dict, not "
                      f"{type(weights).__name__}.", hint=hint, id=E017_BAD_FAIR_WEIGHTS)]
    return [Error(f"{SETTING_NAME}['FAIR_WEIGHTS'][{key!r:.80}]: {problem}, not {value!r:.40}.",
                  hint=hint, id=E017_BAD_FAIR_WEIGHTS)
            for key, value in weights.items()
            if (problem := weight_problem(key, value)) is not None]


def _number_problem(key: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "must be a number"
    if isinstance(value, float) and not math.isfinite(value):  # any int is finite
        # An infinite LEASE_TTL overflows the lease arithmetic; NaN compares false to all.
        return "must be a finite number"
    least = 1 if key in _AT_LEAST_ONE else 0
    if key in _INTEGERS and (not isinstance(value, int) or value < least):
        return f"must be a whole number >= {least}"
    if key in _CAPS:
        most = LARGEST_SIZE if key in _SIZES else LARGEST_COUNT
        if not isinstance(value, int) or not 1 <= value <= most:
            return f"must be a whole number from 1 to {most}"
        return None
    if key in _POSITIVE and not value > 0:
        return "must be > 0"
    if key in _NON_NEGATIVE and value < 0:
        return "must be >= 0"
    if key == "BACKOFF_JITTER" and not 0 <= value <= 1:
        return "must be between 0 and 1"
    if key in _INTEGERS and value > LARGEST_COUNT:
        return f"must be at most {LARGEST_COUNT}"
    if key in _POSITIVE + _NON_NEGATIVE and value > LONGEST_DURATION:
        return f"must be at most {LONGEST_DURATION} (a year)"
    return None


# Neither SQLite check opens a connection, so both run in `manage.py check` as in `migrate`
# (a "database"-tagged check runs only in the latter, and a new user saw them differ).
@register()
def check_sqlite(app_configs: Any = None, databases: Any = None,
                 **kwargs: Any) -> list[CheckMessage]:
    db = settings.DATABASES.get("default", {})
    if "sqlite" not in db.get("ENGINE", ""):
        return []
    mode = str(db.get("OPTIONS", {}).get("transaction_mode", "")).upper()
    if mode not in ("IMMEDIATE", "EXCLUSIVE"):  # both take the write lock at BEGIN
        return [Warning(
            "SQLite runs transactions DEFERRED: concurrent workers meet 'database is locked' "
            "and retry far more often.",
            hint=SQLITE_HINT,
            id=W001_SQLITE_DEFERRED)]
    return []


@register()
def check_sqlite_journal(app_configs: Any = None, databases: Any = None,
                         **kwargs: Any) -> list[CheckMessage]:
    """WAL from the settings' init_command, else from the database file's header (WAL is a
    property of the file); no connection is opened."""
    db = settings.DATABASES.get("default", {})
    if "sqlite" not in db.get("ENGINE", ""):
        return []
    init = str(db.get("OPTIONS", {}).get("init_command", ""))
    if re.search(r"journal_mode\s*=\s*['\"]?wal", init, flags=re.IGNORECASE):
        return []
    return journal_warning(file_journal_mode(str(db.get("NAME", ""))))


def file_journal_mode(name: str) -> str:
    """"wal" if the SQLite file's header says WAL (bytes 18 and 19 are 2), "delete" if it
    says otherwise, "memory" for an in-memory database, "" if there is no file yet."""
    if name == ":memory:" or "mode=memory" in name:
        return "memory"
    try:
        with open(name, "rb") as file:
            header = file.read(20)
    except OSError:
        return ""
    if len(header) < 20 or not header.startswith(b"SQLite format 3\x00"):
        return ""
    return "wal" if header[18] == header[19] == 2 else "delete"


@register()
def check_connections(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    db = settings.DATABASES.get("default", {})
    return reconnect_warning(db) if "postgresql" in db.get("ENGINE", "") else []


def _journal_mode() -> str:
    from django.db import connections

    with connections["default"].cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        row = cursor.fetchone()
    return str(row[0]) if row else ""


def journal_warning(mode: str) -> list[CheckMessage]:
    """Without WAL every reader blocks the writer: several workers then mostly wait."""
    if mode.lower() in ("wal", "memory"):
        return []
    return [Warning(
        f"SQLite's journal_mode is {mode or 'not set'}, not WAL: readers block the writer, "
        "so several workers (and the admin) wait on each other and time out.",
        hint=SQLITE_HINT,
        id=W002_SQLITE_NOT_WAL)]


def reconnect_warning(db: dict[str, Any]) -> list[CheckMessage]:
    """CONN_MAX_AGE=0 without a pool: a worker opens a new connection for every run."""
    if db.get("CONN_MAX_AGE", 0) != 0 or db.get("OPTIONS", {}).get("pool"):
        return []
    return [Warning(
        "CONN_MAX_AGE is 0 and no connection pool is configured: every run a worker executes "
        "opens and closes its own PostgreSQL connection, a few milliseconds each.",
        hint="For worker processes set DATABASES['default']['CONN_MAX_AGE'] = None (or 600), "
             "or OPTIONS = {'pool': True} (psycopg[pool]).",
        id=W004_RECONNECT_PER_RUN)]


def check_worker_connections(concurrency: int, own: int, sync_agents: bool,
                             max_connections: int | None,
                             processes: int = 1) -> list[CheckMessage]:
    """Run by `runworker` at start (it alone knows `--concurrency` and `--processes`): each
    worker process holds `own` connections whatever its concurrency, and each thread of a
    sync agent that runs its own ORM queries opens one more. Warn when the processes'
    connections could pass the server's `max_connections` (None: not PostgreSQL, or not
    known)."""
    per_process = own + (concurrency if sync_agents else 0)
    total = processes * per_process
    if max_connections is None or total <= max_connections:
        return []
    where = f"runworker --processes {processes} --concurrency {concurrency}" \
        if processes > 1 else f"runworker --concurrency {concurrency}"
    agents = (f"if each sync agent opens its own connection (its own ORM queries), this "
              f"worker may hold {total} connections ({processes * own} of its own)"
              if sync_agents else f"this worker holds {total} connections")
    return [Warning(
        f"{where}: {agents}, past the server's max_connections ({max_connections}).",
        hint="Each process holds its own connections; the worker's own writes need none per "
             "attempt. Lower --processes or --concurrency; for agents' queries use Django's "
             "pool (OPTIONS = {'pool': {...}}, psycopg[pool]) or a pooler; or raise "
             "max_connections (docs/deployment.md, sizing).",
        id=W008_CONNECTIONS)]


def server_max_connections() -> int | None:
    """PostgreSQL's `max_connections`, or None (another engine, or it cannot be read)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    try:
        with connection.cursor() as cursor:
            cursor.execute("SHOW max_connections")
            return int(cursor.fetchone()[0])
    except Exception:
        return None
