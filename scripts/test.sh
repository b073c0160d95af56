#!/usr/bin/env bash
# The full check, as `make test` runs it: migrations, lint, types, then the test suite on
# SQLite and on PostgreSQL, the two passes side by side (TEST_SERIAL=1: one after the
# other, output live). Extra arguments go to pytest.
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
if [[ -z $pg_url && ${REQUIRE_POSTGRES:-0} == 1 ]]; then
  printf '\n!!! FAIL: REQUIRE_POSTGRES=1 but no PostgreSQL: DATABASE_URL is not a postgres URL\n' >&2
  printf '!!! and nothing answers at %s.\n' "$LOCAL_PG_PROBE" >&2
  exit 1
fi

# pytest_pass NAME URL: one pass of the suite; its output goes to .tmp/test-NAME.log when the
# passes run side by side, else to the terminal.
pytest_pass() {
  local name=$1 url=$2 started=$SECONDS status=0
  if [[ ${SIDE_BY_SIDE:-0} == 1 ]]; then
    DATABASE_URL=$url "$PY" -m pytest -p no:cacheprovider "${PYTEST_PASS_ARGS[@]}" \
      >".tmp/test-$name.log" 2>&1 || status=$?
  else
    DATABASE_URL=$url "$PY" -m pytest "${PYTEST_PASS_ARGS[@]}" || status=$?
  fi
  printf '    %s pass: exit %s after %ss\n' "$name" "$status" "$((SECONDS - started))"
  return "$status"
}
PYTEST_PASS_ARGS=("$@")

ran=("SQLite")
if [[ -n $pg_url ]]; then
  # The test database is test_<name>; the named database itself need not exist.
  shown=$(sed -E 's#(://[^:/@]*):[^@]*@#\1:***@#' <<<"$pg_url")  # hide a password
  ran+=("PostgreSQL")
fi

if [[ -n $pg_url && ${TEST_SERIAL:-0} != 1 ]]; then
  # Side by side: most of the suite waits on worker subprocesses, leases and sockets, so two
  # passes on two cores take little longer than one (TEST_SERIAL=1 runs them one by one).
  # Each pass has its own database (a SQLite file per process; test_<name> on PostgreSQL).
  step "pytest on SQLite and on PostgreSQL ($pg_from: $shown), side by side"
  echo "    output: .tmp/test-sqlite.log and .tmp/test-postgres.log, printed when both end"
  set +e
  SIDE_BY_SIDE=1 pytest_pass sqlite "$SQLITE_URL" &
  sqlite_job=$!
  SIDE_BY_SIDE=1 pytest_pass postgres "$pg_url" &
  postgres_job=$!
  wait "$sqlite_job"; sqlite_status=$?
  wait "$postgres_job"; postgres_status=$?
  set -e
  # A failed pass prints last, so its summary ends the output.
  for name in sqlite postgres; do
    status_var="${name}_status"
    if [[ ${!status_var} == 0 ]]; then step "pytest on $name: output"; cat ".tmp/test-$name.log"; fi
  done
  for name in sqlite postgres; do
    status_var="${name}_status"
    if [[ ${!status_var} != 0 ]]; then step "pytest on $name FAILED: output"; cat ".tmp/test-$name.log"; fi
  done
  if [[ $sqlite_status != 0 || $postgres_status != 0 ]]; then
    printf '\n!!! FAIL: pytest on SQLite exited %s, on PostgreSQL %s\n' "$sqlite_status" "$postgres_status" >&2
    exit 1
  fi
else
  step "pytest on SQLite"
  pytest_pass sqlite "$SQLITE_URL"
  if [[ -n $pg_url ]]; then
    step "pytest on PostgreSQL ($pg_from: $shown)"
    pytest_pass postgres "$pg_url"
  else
    printf '\n!!! PostgreSQL SKIPPED: DATABASE_URL is not a postgres URL and nothing answers at\n'
    printf '!!! 127.0.0.1:5432. Set DATABASE_URL=postgres://USER@HOST:PORT/NAME to test on it.\n'
  fi
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
