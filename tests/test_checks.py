"""System checks on AGENTRUNS and the database: each id fires for a bad value, none for good."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.core.checks import CheckMessage, Error, Warning, registry, run_checks
from django.test import override_settings

from django_agentruns import checks
from django_agentruns.conf import Defaults

CHECK_IDS = {value for value in vars(checks).values()
             if isinstance(value, str) and re.fullmatch(r"agentruns\.[EW]\d{3}", value)}


def agentruns_messages() -> list[CheckMessage]:
    """Every message of the app's checks (called directly: Django's model checks need a DB)."""
    return [*checks.check_settings(), *checks.check_sqlite(databases=["default"])]


def with_agentruns(value: Any) -> list[CheckMessage]:
    with override_settings(AGENTRUNS=value):
        return agentruns_messages()


# (case id, AGENTRUNS value, check id expected, text the message must contain)
BAD_SETTINGS: list[tuple[str, Any, str, str]] = [
    ("list", ["LEASE_TTL", 60], checks.E001_NOT_A_DICT, "must be a dict"),
    ("string", "LEASE_TTL=60", checks.E001_NOT_A_DICT, "must be a dict"),
    ("typo", {"LEASE_TLL": 60}, checks.E002_UNKNOWN_SETTING, "'LEASE_TLL'"),
    ("lowercase", {"lease_ttl": 60}, checks.E002_UNKNOWN_SETTING, "'lease_ttl'"),
    ("ttl-zero", {"LEASE_TTL": 0}, checks.E003_BAD_NUMBER, "'LEASE_TTL'"),
    ("ttl-negative", {"LEASE_TTL": -1}, checks.E003_BAD_NUMBER, "'LEASE_TTL'"),
    ("ttl-string", {"LEASE_TTL": "60"}, checks.E003_BAD_NUMBER, "'LEASE_TTL'"),
    ("ttl-bool", {"LEASE_TTL": True}, checks.E003_BAD_NUMBER, "'LEASE_TTL'"),
    ("steps-cap-zero", {"MAX_STEPS_PER_RUN": 0}, checks.E003_BAD_NUMBER, "'MAX_STEPS_PER_RUN'"),
    ("steps-cap-float", {"MAX_STEPS_PER_RUN": 1.5}, checks.E003_BAD_NUMBER,
     "'MAX_STEPS_PER_RUN'"),
    ("ttl-nan", {"LEASE_TTL": float("nan")}, checks.E003_BAD_NUMBER, "'LEASE_TTL'"),
    ("ttl-inf", {"LEASE_TTL": float("inf")}, checks.E003_BAD_NUMBER, "'LEASE_TTL'"),
    ("ttl-short", {"LEASE_TTL": 0.2}, checks.W003_SHORT_LEASE, "loses the run"),
    ("poll-zero", {"POLL_INTERVAL": 0}, checks.E003_BAD_NUMBER, "'POLL_INTERVAL'"),
    ("depth-zero", {"MAX_SPAWN_DEPTH": 0}, checks.E003_BAD_NUMBER, "'MAX_SPAWN_DEPTH'"),
    ("children-float", {"MAX_CHILDREN_PER_RUN": 1.5}, checks.E003_BAD_NUMBER,
     "'MAX_CHILDREN_PER_RUN'"),
    ("deliveries-negative", {"MAX_DELIVERIES_PER_RUN": -1}, checks.E003_BAD_NUMBER,
     "'MAX_DELIVERIES_PER_RUN'"),
    ("poll-inf", {"POLL_INTERVAL": float("inf")}, checks.E003_BAD_NUMBER, "'POLL_INTERVAL'"),
    ("base-negative", {"BACKOFF_BASE": -1}, checks.E003_BAD_NUMBER, "'BACKOFF_BASE'"),
    ("base-nan", {"BACKOFF_BASE": float("nan")}, checks.E003_BAD_NUMBER, "'BACKOFF_BASE'"),
    ("cap-negative", {"BACKOFF_CAP": -5}, checks.E003_BAD_NUMBER, "'BACKOFF_CAP'"),
    ("reap-negative", {"REAP_INTERVAL": -0.5}, checks.E003_BAD_NUMBER, "'REAP_INTERVAL'"),
    ("grace-negative", {"GRACE": -1}, checks.E003_BAD_NUMBER, "'GRACE'"),
    ("grace-inf", {"GRACE": float("inf")}, checks.E003_BAD_NUMBER, "'GRACE'"),
    ("requeues-negative", {"MAX_REQUEUES": -1}, checks.E003_BAD_NUMBER, "'MAX_REQUEUES'"),
    ("requeues-float", {"MAX_REQUEUES": 2.5}, checks.E003_BAD_NUMBER, "'MAX_REQUEUES'"),
    ("batch-zero", {"CLAIM_BATCH": 0}, checks.E003_BAD_NUMBER, "'CLAIM_BATCH'"),
    ("streams-per-user-zero", {"STREAMS_PER_USER": 0}, checks.E003_BAD_NUMBER,
     "'STREAMS_PER_USER'"),
    ("streams-per-user-float", {"STREAMS_PER_USER": 2.5}, checks.E003_BAD_NUMBER,
     "'STREAMS_PER_USER'"),
    ("streams-per-process-negative", {"STREAMS_PER_PROCESS": -1}, checks.E003_BAD_NUMBER,
     "'STREAMS_PER_PROCESS'"),
    ("streams-per-process-string", {"STREAMS_PER_PROCESS": "50"}, checks.E003_BAD_NUMBER,
     "'STREAMS_PER_PROCESS'"),
    ("prepared-string", {"PREPARED_STATEMENTS": "yes"}, checks.E009_NOT_A_FLAG,
     "'PREPARED_STATEMENTS'"),
    ("unknown-errors-int", {"UNKNOWN_ERRORS_RETRYABLE": 1}, checks.E009_NOT_A_FLAG,
     "'UNKNOWN_ERRORS_RETRYABLE'"),
    ("batch-none", {"CLAIM_BATCH": None}, checks.E003_BAD_NUMBER, "'CLAIM_BATCH'"),
    ("writers-zero", {"WRITER_CONNECTIONS": 0}, checks.E003_BAD_NUMBER,
     "'WRITER_CONNECTIONS'"),
    ("writers-float", {"WRITER_CONNECTIONS": 1.5}, checks.E003_BAD_NUMBER,
     "'WRITER_CONNECTIONS'"),
    ("writers-string", {"WRITER_CONNECTIONS": "2"}, checks.E003_BAD_NUMBER,
     "'WRITER_CONNECTIONS'"),
    ("jitter-above-one", {"BACKOFF_JITTER": 1.5}, checks.E003_BAD_NUMBER, "'BACKOFF_JITTER'"),
    ("jitter-negative", {"BACKOFF_JITTER": -0.1}, checks.E003_BAD_NUMBER, "'BACKOFF_JITTER'"),
    ("classifier-missing-module", {"CLASSIFIER": "no_such_module.classify"},
     checks.E004_BAD_CLASSIFIER, "no_such_module.classify"),
    ("classifier-missing-attr", {"CLASSIFIER": "django_agentruns.rules.policy.no_such_function"},
     checks.E004_BAD_CLASSIFIER, "no_such_function"),
    ("classifier-not-dotted", {"CLASSIFIER": "classify"}, checks.E004_BAD_CLASSIFIER,
     "'classify'"),
    ("classifier-not-callable", {"CLASSIFIER": "django_agentruns.conf.SETTING_NAME"},
     checks.E004_BAD_CLASSIFIER, "SETTING_NAME"),
    ("classifier-not-a-string", {"CLASSIFIER": 42}, checks.E004_BAD_CLASSIFIER, "42"),
    ("stream-access-missing", {"STREAM_ACCESS": "no_such_module.allowed"},
     checks.E015_BAD_STREAM_ACCESS, "'STREAM_ACCESS'"),
    ("stream-access-not-callable", {"STREAM_ACCESS": "django_agentruns.conf.SETTING_NAME"},
     checks.E015_BAD_STREAM_ACCESS, "SETTING_NAME"),
    ("waiters-zero", {"WAITERS_PER_PROCESS": 0}, checks.E003_BAD_NUMBER,
     "'WAITERS_PER_PROCESS'"),
    ("queue-empty", {"DEFAULT_QUEUE": ""}, checks.E005_BAD_QUEUE, "DEFAULT_QUEUE"),
    ("queue-int", {"DEFAULT_QUEUE": 3}, checks.E005_BAD_QUEUE, "DEFAULT_QUEUE"),
    ("queue-too-long", {"DEFAULT_QUEUE": "q" * 101}, checks.E005_BAD_QUEUE, "DEFAULT_QUEUE"),
    ("cap-below-base", {"BACKOFF_BASE": 10, "BACKOFF_CAP": 5}, checks.E006_BACKOFF_ORDER,
     "BACKOFF_CAP"),
    ("cap-below-default-base", {"BACKOFF_CAP": 1}, checks.E006_BACKOFF_ORDER, "BACKOFF_CAP"),
    ("metrics-token-short", {"METRICS_TOKEN": "secret"}, checks.E007_BAD_METRICS_TOKEN,
     "6-character string"),
    ("metrics-token-int", {"METRICS_TOKEN": 1234567890123456789}, checks.E007_BAD_METRICS_TOKEN,
     "not a value of type int"),
    ("checkpoint-history-zero", {"CHECKPOINT_HISTORY": 0}, checks.E003_BAD_NUMBER,
     "'CHECKPOINT_HISTORY'"),
    ("checkpoint-history-string", {"CHECKPOINT_HISTORY": "20"}, checks.E003_BAD_NUMBER,
     "'CHECKPOINT_HISTORY'"),
    ("snoozes-negative", {"MAX_SNOOZES": -1}, checks.E003_BAD_NUMBER, "'MAX_SNOOZES'"),
    ("snoozes-float", {"MAX_SNOOZES": 2.5}, checks.E003_BAD_NUMBER, "'MAX_SNOOZES'"),
    ("limits-list", {"LIMITS": [("openai", 2)]}, checks.E011_BAD_LIMITS, "must be a dict"),
    ("fair-weights-list", {"FAIR_WEIGHTS": ["a"]}, checks.E017_BAD_FAIR_WEIGHTS, "must be a dict"),
    ("fair-weight-zero", {"FAIR_WEIGHTS": {"a": 0}}, checks.E017_BAD_FAIR_WEIGHTS, "'a'"),
    ("limit-negative", {"LIMITS": {"openai": -1}}, checks.E011_BAD_LIMITS, "'openai'"),
    ("limit-float", {"LIMITS": {"openai": 2.5}}, checks.E011_BAD_LIMITS, "max_running"),
    ("limit-none", {"LIMITS": {"openai": None}}, checks.E011_BAD_LIMITS, "not None"),
    ("limit-key-empty", {"LIMITS": {"": 3}}, checks.E011_BAD_LIMITS, "1-200 characters"),
    ("limit-key-int", {"LIMITS": {5: 3}}, checks.E011_BAD_LIMITS, "1-200 characters"),
    ("prices-list", {"MODEL_PRICES": [("gpt-4o", 1)]}, checks.E016_BAD_MODEL_PRICES,
     "must be a dict"),
    ("price-number", {"MODEL_PRICES": {"gpt-4o": 2.5}}, checks.E016_BAD_MODEL_PRICES,
     '{"input": X, "output": Y}'),
    ("price-missing-output", {"MODEL_PRICES": {"gpt-4o": {"input": 2.5}}},
     checks.E016_BAD_MODEL_PRICES, "'gpt-4o'"),
    ("price-negative", {"MODEL_PRICES": {"gpt-4o": {"input": -1, "output": 1}}},
     checks.E016_BAD_MODEL_PRICES, "input must be a finite number >= 0"),
    ("price-nan", {"MODEL_PRICES": {"gpt-4o": {"input": 1, "output": float("nan")}}},
     checks.E016_BAD_MODEL_PRICES, "output must be"),
    ("price-text", {"MODEL_PRICES": {"gpt-4o": {"input": "0.15", "output": 1}}},
     checks.E016_BAD_MODEL_PRICES, "input must be"),
    ("price-star-inside", {"MODEL_PRICES": {"gpt-*-mini": {"input": 1, "output": 1}}},
     checks.E016_BAD_MODEL_PRICES, "one '*' at its end"),
    ("price-key-empty", {"MODEL_PRICES": {"": {"input": 1, "output": 1}}},
     checks.E016_BAD_MODEL_PRICES, "1-100 characters"),
]


@pytest.mark.parametrize(("value", "check_id", "text"), [c[1:] for c in BAD_SETTINGS],
                         ids=[c[0] for c in BAD_SETTINGS])
def test_a_bad_setting_fires_its_check(value: Any, check_id: str, text: str) -> None:
    messages = with_agentruns(value)
    assert [m.id for m in messages] == [check_id], messages
    (message,) = messages
    assert isinstance(message, Warning if ".W" in check_id else Error)
    assert text in message.msg
    assert message.hint, f"{check_id} gives no hint"


def test_every_problem_is_reported_at_once() -> None:
    messages = with_agentruns({"LEASE_TTL": 0, "TYPO": 1, "DEFAULT_QUEUE": "",
                               "CLASSIFIER": "nowhere.f", "BACKOFF_BASE": 9, "BACKOFF_CAP": 3})
    assert sorted(m.id for m in messages if m.id) == sorted([
        checks.E002_UNKNOWN_SETTING, checks.E003_BAD_NUMBER,
        checks.E004_BAD_CLASSIFIER, checks.E005_BAD_QUEUE, checks.E006_BACKOFF_ORDER])


def _sqlite(options: dict[str, Any]) -> dict[str, Any]:
    return {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "unused.sqlite3",
                        "OPTIONS": options}}


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
@pytest.mark.parametrize("options", [{}, {"transaction_mode": "DEFERRED"},
                                     {"timeout": 20}], ids=["none", "deferred", "no-mode"])
def test_sqlite_without_immediate_transactions_warns(options: dict[str, Any]) -> None:
    with override_settings(DATABASES=_sqlite(options)):
        messages = checks.check_sqlite(databases=["default"])
    assert [m.id for m in messages] == [checks.W001_SQLITE_DEFERRED]
    (message,) = messages
    assert isinstance(message, Warning)
    assert "IMMEDIATE" in (message.hint or "")


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
@pytest.mark.parametrize("mode", ["IMMEDIATE", "immediate", "EXCLUSIVE"])
def test_sqlite_with_a_write_lock_at_begin_is_fine(mode: str) -> None:
    with override_settings(DATABASES=_sqlite({"transaction_mode": mode})):
        assert checks.check_sqlite(databases=["default"]) == []


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_postgresql_gets_no_sqlite_warning() -> None:
    databases = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}}
    with override_settings(DATABASES=databases):
        assert checks.check_sqlite(databases=["default"]) == []


def test_the_checks_are_registered_with_django() -> None:
    assert checks.check_settings in registry.registry.get_checks()
    assert checks.check_sqlite in registry.registry.get_checks()


@pytest.mark.django_db
def test_manage_py_check_reports_a_bad_setting() -> None:
    with override_settings(AGENTRUNS={"LEASE_TTL": -1}):
        ids = [m.id for m in run_checks(databases=["default"])]
    assert checks.E003_BAD_NUMBER in ids


def test_every_check_id_is_exercised() -> None:
    """A check added to checks.py without a bad case here fails this test."""
    exercised = {c[2] for c in BAD_SETTINGS} | {checks.W001_SQLITE_DEFERRED,
                                                 checks.W002_SQLITE_NOT_WAL,
                                                 checks.W004_RECONNECT_PER_RUN,
                                                 checks.W008_CONNECTIONS,
                                                 # tests/test_step_replay.py
                                                 checks.W009_PINNED_VERSIONS,
                                                 # tests/test_partitions.py
                                                 checks.E020_BAD_HISTORY_PARTITION,
                                                 checks.W020_HISTORY_LAYOUT}
    assert exercised == CHECK_IDS
    assert len(CHECK_IDS) >= 7


# --------------------------------------------------------------------------- good settings


def test_the_test_settings_pass(settings: Any) -> None:
    assert [m for m in agentruns_messages() if m.id not in settings.SILENCED_SYSTEM_CHECKS] == []


def test_every_setting_at_its_default_passes() -> None:
    defaults = {name: getattr(Defaults, name) for name in Defaults.__dataclass_fields__}
    assert with_agentruns(defaults) == []


@pytest.mark.parametrize(
    "value",
    [
        None,
        {},
        {"LEASE_TTL": 1.0, "POLL_INTERVAL": 0.01, "MAX_REQUEUES": 0, "CLAIM_BATCH": 1,
         "WRITER_CONNECTIONS": 1,
         "BACKOFF_BASE": 0, "BACKOFF_CAP": 0, "BACKOFF_JITTER": 0, "REAP_INTERVAL": 0,
         "GRACE": 0, "DEFAULT_QUEUE": "q" * 100,
         "CLASSIFIER": "django_agentruns.rules.policy.http_status",
         "UNKNOWN_ERRORS_RETRYABLE": False},
        {"BACKOFF_BASE": 5, "BACKOFF_CAP": 5, "BACKOFF_JITTER": 1, "LEASE_TTL": 600},
        {"CLASSIFIER": None},
        {"LIMITS": {"openai": 20, "tenant:42": 0}, "MAX_SNOOZES": 0},
        {"CHECKPOINT_HISTORY": None},
        {"CHECKPOINT_HISTORY": 1},
    ],
    ids=["none", "empty", "edges", "equal-backoff", "no-classifier", "limits",
         "all-checkpoints", "one-checkpoint"],
)
def test_good_settings_pass(value: Any) -> None:
    assert with_agentruns(value) == []


def test_no_setting_at_all_passes(settings: Any) -> None:
    del settings.AGENTRUNS
    assert [m for m in agentruns_messages() if m.id not in settings.SILENCED_SYSTEM_CHECKS] == []


@pytest.mark.parametrize("ttl", [0.1, 0.99])
def test_a_lease_shorter_than_a_second_warns(ttl: float) -> None:
    messages = with_agentruns({"LEASE_TTL": ttl})
    assert [m.id for m in messages] == [checks.W003_SHORT_LEASE]
    assert isinstance(messages[0], Warning)


@pytest.mark.parametrize("mode", ["delete", "truncate", "persist", ""])
def test_sqlite_without_wal_warns(mode: str) -> None:
    (message,) = checks.journal_warning(mode)
    assert message.id == checks.W002_SQLITE_NOT_WAL
    assert "journal_mode=WAL" in (message.hint or "")


@pytest.mark.parametrize("mode", ["wal", "WAL", "memory"])
def test_sqlite_with_wal_is_fine(mode: str) -> None:
    assert checks.journal_warning(mode) == []


@pytest.mark.sqlite_only
@pytest.mark.django_db
def test_the_live_sqlite_test_database_runs_wal() -> None:
    assert checks.journal_warning(checks._journal_mode()) == []


@pytest.mark.parametrize(("db", "warns"), [
    ({"ENGINE": "django.db.backends.postgresql"}, True),
    ({"ENGINE": "django.db.backends.postgresql", "CONN_MAX_AGE": 0}, True),
    ({"ENGINE": "django.db.backends.postgresql", "CONN_MAX_AGE": None}, False),
    ({"ENGINE": "django.db.backends.postgresql", "CONN_MAX_AGE": 600}, False),
    ({"ENGINE": "django.db.backends.postgresql", "OPTIONS": {"pool": True}}, False),
], ids=["default", "zero", "persistent", "max-age", "pool"])
def test_postgresql_reconnecting_per_run_warns(db: dict[str, Any], warns: bool) -> None:
    ids = [m.id for m in checks.reconnect_warning(db)]
    assert ids == ([checks.W004_RECONNECT_PER_RUN] if warns else [])


# --------------------------------------------------------------------------- runworker's check


@pytest.mark.parametrize(("concurrency", "sync_agents", "max_connections", "warns"), [
    (300, True, 100, True),  # 300 agents' connections + the worker's 5 > 100
    (95, True, 100, False),  # 95 + 5 fits
    (96, True, 100, True),
    (300, False, 100, False),  # async agents only: no thread, no connection each
    (300, True, None, False),  # not PostgreSQL (or unknown): nothing to compare with
])
def test_runworker_warns_when_sync_agents_could_pass_max_connections(
        concurrency: int, sync_agents: bool, max_connections: int | None, warns: bool) -> None:
    messages = checks.check_worker_connections(concurrency, 5, sync_agents, max_connections)
    assert [m.id for m in messages] == ([checks.W008_CONNECTIONS] if warns else [])
    if warns:
        assert f"may hold {concurrency + 5} connections" in messages[0].msg


@pytest.mark.slow
def test_runworker_prints_its_connections_and_the_warning(
        worker_env: dict[str, str]) -> None:
    from tests import helpers

    env = {**worker_env, "AGENTRUNS_TEST_SETTINGS": '{"WRITER_CONNECTIONS": 3}'}
    done = helpers.run_manage(["runworker", "--burst", "--concurrency", "100000"], env)
    assert done.returncode == 0, done.stderr
    postgres = worker_env["DATABASE_URL"].startswith("postgres")
    # Writers, claim loop, lease keeper, the live-chunk sender; the listener on PostgreSQL.
    own = 3 + 3 + (1 if postgres else 0)
    assert f"concurrency 100000, {own} database connections" in done.stdout, done.stdout
    assert (checks.W008_CONNECTIONS in done.stderr) is postgres, done.stderr


# --------------------------------------------------------------------------- a fresh project


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_a_fresh_sqlite_project_hears_both_warnings_from_check_as_from_migrate(
        tmp_path: Any) -> None:
    fresh = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": str(tmp_path / "db.sqlite3")}}
    with override_settings(DATABASES=fresh):
        plain = [m for m in run_checks() if m.id.startswith("agentruns.")]  # manage.py check
        with_db = [m for m in run_checks(databases=["default"])  # migrate
                   if m.id.startswith("agentruns.")]
    assert sorted(m.id for m in plain) == sorted(m.id for m in with_db) == [
        checks.W001_SQLITE_DEFERRED, checks.W002_SQLITE_NOT_WAL]
    for message in plain:  # one fix, with the values SQLITE_OPTIONS and docs/getting-started.md use
        assert "'timeout': 30" in (message.hint or "")
        assert "SQLITE_OPTIONS" in (message.hint or "")
    assert not (tmp_path / "db.sqlite3").exists()  # nothing was opened


def test_the_journal_mode_is_read_from_the_file_header(tmp_path: Any) -> None:
    import sqlite3

    path = tmp_path / "db.sqlite3"
    assert checks.file_journal_mode(str(path)) == ""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x)")
    assert checks.file_journal_mode(str(path)) == "delete"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
    assert checks.file_journal_mode(str(path)) == "wal"
    assert checks.file_journal_mode(":memory:") == "memory"
    with override_settings(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                                  "NAME": str(path)}}):
        assert checks.check_sqlite_journal() == []


@pytest.mark.parametrize(("processes", "concurrency", "sync_agents", "warns"), [
    (4, 20, True, False),  # 4 x (20 + 5) = 100 fits
    (4, 21, True, True),  # 4 x 26 = 104 > 100
    (2, 40, True, False),  # 2 x 45 = 90
    (21, 300, False, True),  # async only: 21 x 5 = 105 of the workers' own
    (20, 300, False, False),  # 20 x 5 = 100
])
def test_runworker_warns_when_its_processes_could_pass_max_connections(
        processes: int, concurrency: int, sync_agents: bool, warns: bool) -> None:
    messages = checks.check_worker_connections(concurrency, 5, sync_agents, 100, processes)
    assert [m.id for m in messages] == ([checks.W008_CONNECTIONS] if warns else [])
    if warns:
        assert f"--processes {processes}" in messages[0].msg


def test_manage_py_check_runs_the_settings_checks_in_a_fresh_process() -> None:
    """The app registers its checks itself (AppConfig.ready): a project that never imports
    `django_agentruns.checks` still has a bad setting reported by `manage.py check`."""
    import json
    import os

    from tests import helpers

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
           "AGENTRUNS_TEST_SETTINGS": json.dumps({"LIMITS": {"b": {"per_hour": 3}}})}
    result = helpers.run_manage(["check"], env)
    assert result.returncode != 0
    assert "agentruns.E011" in result.stderr, result.stderr
