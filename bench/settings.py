"""Django settings for the benchmark: all three engines installed side by side.

The database comes from ``DATABASE_URL``; the harness points each worker and client
process at a fresh database of its own. Workers keep their connections
(``CONN_MAX_AGE=None``), as a long-running worker should.
"""

from __future__ import annotations

import environ

env = environ.Env()

DATABASES = {
    "default": env.db("DATABASE_URL",
                      default="postgres://postgres@127.0.0.1:5432/agentruns_bench"),
}
DATABASES["default"]["CONN_MAX_AGE"] = None
if env.int("BENCH_DB_POOL", default=0):
    # Django's psycopg pool (Django >= 5.1): threads borrow a connection per request
    # instead of keeping one each. The pool replaces persistent connections.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {
        "pool": {"min_size": 2, "max_size": env.int("BENCH_DB_POOL"), "timeout": 60}}
if env.str("BENCH_LISTEN_URL", default=""):
    # `default` goes through a transaction pooler (bench/pooler.py): the listener connects
    # directly, and server-side cursors are off for the pooled alias.
    DATABASES["listen"] = env.db("BENCH_LISTEN_URL")
    DATABASES["listen"]["CONN_MAX_AGE"] = None
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }

SECRET_KEY = "agentruns-bench-not-a-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_agentruns",
    "django_tasks_db",
    "procrastinate.contrib.django",
    "bench.benchapp",
]
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # procrastinate is PostgreSQL-only; the SQLite rows measure ours alone.
    INSTALLED_APPS.remove("procrastinate.contrib.django")

# Ours: poll once a second when idle (PostgreSQL workers are woken by NOTIFY anyway).
AGENTRUNS = {"POLL_INTERVAL": 1.0,
             "PREPARED_STATEMENTS": env.bool("BENCH_PREPARED", default=True),
             "LISTEN_DATABASE": "listen" if "listen" in DATABASES else None,
             # bench/fair.py: weights of the fairness groups of its runs (JSON)
             "FAIR_WEIGHTS": env.json("BENCH_FAIR_WEIGHTS", default={}),
             # bench/history.py: the partitioned layout's span (run ids per partition).
             "HISTORY_PARTITION": env.int("BENCH_HISTORY_PARTITION", default=0) or None,
             # Experiments: any other setting, as JSON ({"CLAIM_BATCH": 64}).
             **env.json("BENCH_AGENTRUNS", default={})}

# django-tasks-db: the database backend of Django's task framework.
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}

# procrastinate: tasks are found in each app's `tasks` module (bench/benchapp/tasks.py).
PROCRASTINATE_AUTODISCOVER_MODULE_NAME = "tasks"

# Every engine logs each job at its own default level; the harness discards worker output.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["stderr"], "level": "WARNING"},
}
