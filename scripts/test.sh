#!/usr/bin/env bash
# The full check, as `make test` runs it: migrations, lint, then the test suite on SQLite
# and on PostgreSQL, the two passes side by side with mypy beside them (TEST_SERIAL=1: one
# after the other and mypy first, output live). Extra arguments go to pytest.
# TEST_AFTER_SQLITE / TEST_AFTER_POSTGRES: a command to run after that pass, in its lane
# (CI's extra jobs; see lane below).
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

# mypy takes about a minute from a cold cache: beside the two passes (below) it costs CI
# only its share of the cores; run alone (TEST_SERIAL=1, or SQLite only) it goes first.
run_mypy() { "$PY" -m mypy django_agentruns; }

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
    DATABASE_URL=$url "$PY" -m pytest -p no:cacheprovider --durations=30 "${PYTEST_PASS_ARGS[@]}" \
      >".tmp/test-$name.log" 2>&1 || status=$?
  else
    DATABASE_URL=$url "$PY" -m pytest "${PYTEST_PASS_ARGS[@]}" || status=$?
  fi
  printf '    %s pass: exit %s after %ss\n' "$name" "$status" "$((SECONDS - started))"
  return "$status"
}
PYTEST_PASS_ARGS=("$@")

# lane NAME URL [AFTER]: a pass, then (when it passed) the command AFTER in the same lane,
# its output into .tmp/after-NAME.log. CI uses it to drain its queue of extra jobs from
# both lanes, each starting as soon as its pass ends (scripts/ci-extra.sh).
lane() {
  local name=$1 url=$2 after=${3:-} started status=0
  pytest_pass "$name" "$url" || return $?
  [[ -n $after ]] || return 0
  started=$SECONDS
  bash -c "$after" >".tmp/after-$name.log" 2>&1 || status=$?
  printf '    after the %s pass, `%s`: exit %s after %ss\n' "$name" "$after" "$status" "$((SECONDS - started))"
  return "$status"
}

ran=("SQLite")
if [[ -n $pg_url ]]; then
  # The test database is test_<name>; the named database itself need not exist.
  shown=$(sed -E 's#(://[^:/@]*):[^@]*@#\1:***@#' <<<"$pg_url")  # hide a password
  ran+=("PostgreSQL")
fi

if [[ -z $pg_url || ${TEST_SERIAL:-0} == 1 ]]; then
  step "mypy"
  run_mypy
fi

if [[ -n $pg_url && ${TEST_SERIAL:-0} != 1 ]]; then
  # Side by side: a pass keeps about one core busy (its own process, the worker
  # subprocesses it starts, the server), so on two cores two passes take little longer
  # than one (TEST_SERIAL=1 runs them one by one).
  # Each pass has its own database (a SQLite file per process; test_<name> on PostgreSQL).
  show_lane() {  # show_lane NAME SUFFIX: a lane's pass output, then its after-command's
    step "pytest on $1$2: output"; cat ".tmp/test-$1.log"
    if [[ -f .tmp/after-$1.log ]]; then step "after the $1 pass$2: output"; cat ".tmp/after-$1.log"; fi
  }
  rm -f .tmp/after-sqlite.log .tmp/after-postgres.log
  step "pytest on SQLite and on PostgreSQL ($pg_from: $shown), side by side"
  echo "    output: .tmp/test-sqlite.log and .tmp/test-postgres.log, printed when both end"
  set +e
  run_mypy >.tmp/mypy.log 2>&1 &
  mypy_job=$!
  SIDE_BY_SIDE=1 lane sqlite "$SQLITE_URL" "${TEST_AFTER_SQLITE:-}" &
  sqlite_job=$!
  SIDE_BY_SIDE=1 lane postgres "$pg_url" "${TEST_AFTER_POSTGRES:-}" &
  postgres_job=$!
  wait "$sqlite_job"; sqlite_status=$?
  wait "$postgres_job"; postgres_status=$?
  wait "$mypy_job"; mypy_status=$?
  set -e
  step "mypy (beside the passes)"; cat .tmp/mypy.log
  # A failed pass prints last, so its summary ends the output.
  for name in sqlite postgres; do
    status_var="${name}_status"
    if [[ ${!status_var} == 0 ]]; then show_lane "$name" ""; fi
  done
  for name in sqlite postgres; do
    status_var="${name}_status"
    if [[ ${!status_var} != 0 ]]; then show_lane "$name" " FAILED"; fi
  done
  if [[ $sqlite_status != 0 || $postgres_status != 0 || $mypy_status != 0 ]]; then
    printf '\n!!! FAIL: pytest on SQLite exited %s, on PostgreSQL %s; mypy exited %s\n' \
      "$sqlite_status" "$postgres_status" "$mypy_status" >&2
    exit 1
  fi
else
  step "pytest on SQLite"
  lane sqlite "$SQLITE_URL" "${TEST_AFTER_SQLITE:-}" || { cat .tmp/after-sqlite.log 2>/dev/null; exit 1; }
  if [[ -n $pg_url ]]; then
    step "pytest on PostgreSQL ($pg_from: $shown)"
    lane postgres "$pg_url" "${TEST_AFTER_POSTGRES:-}" || { cat .tmp/after-postgres.log 2>/dev/null; exit 1; }
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
