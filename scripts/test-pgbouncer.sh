#!/usr/bin/env bash
# The durability suites again, every connection of the tests and their worker processes
# going through a private PgBouncer in transaction mode (Debian's `pgbouncer`, started on a
# free port by tests/pgbouncer.py; the system service is never used), with the listener on
# a direct `listen` alias (LISTEN_DATABASE), as docs/deployment.md recommends. (The
# wake-up tests and the chaos run with a PgBouncer restart, tests/test_pgbouncer.py and
# tests/chaos/test_chaos.py::test_chaos_through_pgbouncer, start their own PgBouncer and
# run in `make test`.)
#
# Needs PostgreSQL at PG_SERVER (default 127.0.0.1:5432). Missing pgbouncer: skipped with a
# loud note, or a failure when REQUIRE_PGBOUNCER=1 (CI). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
PG_SERVER=${PG_SERVER:-127.0.0.1:5432}
NAME=${PGBOUNCER_TEST_DB:-agentruns_pooled}
MODULES=(tests/test_fencing.py tests/test_reaper.py tests/test_cancel.py
         tests/test_graceful_stop.py)

if ! "$PY" -c 'import sys; from tests import pgbouncer; sys.exit(pgbouncer.binary() is None)'; then
  if [[ ${REQUIRE_PGBOUNCER:-0} == 1 ]]; then
    echo "!!! FAIL: REQUIRE_PGBOUNCER=1 but pgbouncer is not installed (apt-get install -y pgbouncer)" >&2
    exit 1
  fi
  printf '\n!!! PGBOUNCER SKIPPED: pgbouncer is not installed (apt-get install -y pgbouncer).\n'
  exit 0
fi

portfile=$(mktemp)
"$PY" -m tests.pgbouncer start "$PG_SERVER" >"$portfile" &
bouncer=$!
trap 'kill $bouncer 2>/dev/null; wait $bouncer 2>/dev/null; rm -f "$portfile"' EXIT
for _ in $(seq 1 100); do
  [[ -s $portfile ]] && break
  sleep 0.2
done
port=$(head -n 1 "$portfile")
[[ -n $port ]] || { echo "FAIL: pgbouncer did not start" >&2; exit 1; }

printf '\n==> durability suites through PgBouncer (transaction mode, port %s; LISTEN direct at %s)\n' \
  "$port" "$PG_SERVER"
DATABASE_URL="postgres://postgres@127.0.0.1:$port/$NAME" \
AGENTRUNS_TEST_DIRECT=$PG_SERVER AGENTRUNS_TEST_PGBOUNCER_PORT=$port \
  "$PY" -m pytest -q "${MODULES[@]}" "$@"
