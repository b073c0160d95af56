"""Settings for the test suite.

The database comes from ``DATABASE_URL`` (default: a SQLite file under ``.tmp/``). The test
database is a file too, never ``:memory:``, because tests start real worker subprocesses
(``python -m django runworker ...``) that must open the same database.
"""

import json
import os
from pathlib import Path

import environ

from django_agentruns.sqlite import SQLITE_OPTIONS

BASE_DIR = Path(__file__).resolve().parent.parent
TMP_DIR = BASE_DIR / ".tmp"
TMP_DIR.mkdir(exist_ok=True)

env = environ.Env()

# Set by tests/conftest.py's ``worker_env`` for worker subprocesses: DATABASE_URL then already
# names the test database the parent test run created, so it is used exactly as given.
IN_TEST_SUBPROCESS = bool(os.environ.get("AGENTRUNS_TEST_SUBPROCESS"))

DATABASES = {
    "default": env.db("DATABASE_URL", default=f"sqlite:///{TMP_DIR / 'tests.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {**SQLITE_OPTIONS}  # IMMEDIATE, timeout, WAL
    if not IN_TEST_SUBPROCESS:
        # One file per test process, so concurrent runs (and pytest-xdist) do not collide.
        stem = Path(DATABASES["default"]["NAME"]).stem
        DATABASES["default"]["TEST"] = {
            "NAME": str(TMP_DIR / f"test-{stem}-{os.getpid()}.sqlite3"),
        }

# Set when DATABASE_URL goes through a transaction pooler (tests.pgbouncer; host:port of the
# server behind it): a "listen" alias then reaches the same database directly, as
# docs/deployment.md recommends, and server-side cursors are off for the pooled alias.
DIRECT = os.environ.get("AGENTRUNS_TEST_DIRECT", "")
if DIRECT:
    host, _, port = DIRECT.rpartition(":")
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    DATABASES["listen"] = {**DATABASES["default"], "HOST": host, "PORT": port,
                           "DISABLE_SERVER_SIDE_CURSORS": False, "TEST": {"MIRROR": "default"}}

# Set by tests/test_read_replica.py for its subprocess (host:port of a streaming replica of
# DATABASE_URL's server, which the test starts): operators' reads go there.
REPLICA = os.environ.get("AGENTRUNS_TEST_REPLICA", "")
if REPLICA:
    host, _, port = REPLICA.rpartition(":")
    DATABASES["replica"] = {**DATABASES["default"], "HOST": host, "PORT": port,
                            "TEST": {"MIRROR": "default"}}

SECRET_KEY = "agentruns-tests-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_agentruns",
    "tests.testapp",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "tests.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast admin logins

# Short timings so lease expiry, reaping and retries happen within a test's patience.
AGENTRUNS: dict[str, object] = {
    "LEASE_TTL": 2.0,
    "POLL_INTERVAL": 0.05,
    "REAP_INTERVAL": 0.5,
    "BACKOFF_BASE": 0.0,
    "BACKOFF_CAP": 0.0,
}
if DIRECT:
    AGENTRUNS["LISTEN_DATABASE"] = "listen"
if REPLICA:
    AGENTRUNS["READ_DATABASE"] = "replica"
# A test can hand a worker subprocess different values (e.g. a longer LEASE_TTL) as JSON;
# `settings` fixture overrides do not reach another process.
AGENTRUNS.update(json.loads(os.environ.get("AGENTRUNS_TEST_SETTINGS", "{}")))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s"},
    },
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
            "formatter": "plain",
        },
    },
    "loggers": {
        # propagate=True keeps pytest's caplog (a root handler) able to see these records.
        "django_agentruns": {"handlers": ["stderr"], "level": "INFO", "propagate": True},
    },
}

# The suite runs PostgreSQL with Django's default CONN_MAX_AGE=0 on purpose: worker threads
# then close their connections after each run, so the test database can be dropped.
SILENCED_SYSTEM_CHECKS = ["agentruns.W004"]
