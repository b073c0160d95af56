#!/usr/bin/env bash
# The full check, as `make test` runs it: migrations, lint, types, then the test suite on
# SQLite and on PostgreSQL. Extra arguments go to pytest.
#
# PostgreSQL: DATABASE_URL if it is a postgres URL; else the local server at 127.0.0.1:5432
# if it answers; else skipped with a loud note, or a failure when REQUIRE_POSTGRES=1.
# Browser tests (Debian's chromium, Playwright): skipped as loudly when missing, or a
# failure when REQUIRE_BROWSER=1 (or CI) is set.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
LOCAL_PG_PROBE="postgres://postgres@127.0.0.1:5432/postgres"
LOCAL_PG_URL="postgres://postgres@127.0.0.1:5432/agentruns"
SQLITE_URL="sqlite:///$PWD/.tmp/tests.sqlite3"
mkdir -p .tmp

step() { printf '\n==> %s\n' "$*"; }

pg_answers() {  # pg_answers URL: can we connect?
  "$PY" - "$1" <<'PY'
import sys

import psycopg

try:
    psycopg.connect(sys.argv[1], connect_timeout=3).close()
except Exception as exc:
    print(f"    ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})")
    sys.exit(1)
PY
}

step "migrations match the models"
DATABASE_URL=$SQLITE_URL "$PY" manage.py makemigrations --check --dry-run --settings tests.settings

step "ruff"
"$PY" -m ruff check .

step "mypy"
"$PY" -m mypy django_agentruns

export AGENTRUNS_BROWSER_MARKER="$PWD/.tmp/browser-not-run"  # tests/conftest.py writes it
rm -f "$AGENTRUNS_BROWSER_MARKER"  # when the browser tests skip

step "pytest on SQLite"
DATABASE_URL=$SQLITE_URL "$PY" -m pytest "$@"
ran=("SQLite")

pg_url=""
case "${DATABASE_URL:-}" in
  postgres://* | postgresql://* | pgsql://* | psql://*)
    pg_url=$DATABASE_URL
    pg_from="DATABASE_URL" ;;
  *)
    step "looking for PostgreSQL at 127.0.0.1:5432"
    if pg_answers "$LOCAL_PG_PROBE"; then
      pg_url=$LOCAL_PG_URL
      pg_from="the local server"
    fi ;;
esac

if [[ -n $pg_url ]]; then
  # The test database is test_<name>; the named database itself need not exist.
  shown=$(sed -E 's#(://[^:/@]*):[^@]*@#\1:***@#' <<<"$pg_url")  # hide a password
  step "pytest on PostgreSQL ($pg_from: $shown)"
  DATABASE_URL=$pg_url "$PY" -m pytest "$@"
  ran+=("PostgreSQL")
elif [[ ${REQUIRE_POSTGRES:-0} == 1 ]]; then
  printf '\n!!! FAIL: REQUIRE_POSTGRES=1 but no PostgreSQL: DATABASE_URL is not a postgres URL\n' >&2
  printf '!!! and nothing answers at %s.\n' "$LOCAL_PG_PROBE" >&2
  exit 1
else
  printf '\n!!! PostgreSQL SKIPPED: DATABASE_URL is not a postgres URL and nothing answers at\n'
  printf '!!! 127.0.0.1:5432. Set DATABASE_URL=postgres://USER@HOST:PORT/NAME to test on it.\n'
fi

browsers="browser tests run"
if [[ -f $AGENTRUNS_BROWSER_MARKER ]]; then
  printf '\n!!! BROWSER TESTS SKIPPED: %s\n' "$(head -n 1 "$AGENTRUNS_BROWSER_MARKER")"
  printf '!!! Install Debian'"'"'s chromium (apt-get install -y chromium) and the test extra'"'"'s\n'
  printf '!!! playwright (never `playwright install`); REQUIRE_BROWSER=1 makes this a failure.\n'
  browsers="browser tests SKIPPED"
fi

if [[ ${#ran[@]} == 2 ]]; then
  printf '\n==> All checks passed. Databases tested: SQLite and PostgreSQL; %s.\n' "$browsers"
else
  printf '\n==> All checks passed. Databases tested: SQLite only (PostgreSQL SKIPPED); %s.\n' "$browsers"
fi
