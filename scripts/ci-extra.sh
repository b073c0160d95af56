#!/usr/bin/env bash
# CI's extra jobs. They share a queue: `.ci/run` fills it, and each lane of
# scripts/test.sh drains it once its pass has ended (TEST_AFTER_SQLITE /
# TEST_AFTER_POSTGRES), so the lane that ends first takes the longest job and neither core
# idles while the other still has work (which pass ends first depends on the machine).
#   queue JOB...      start a fresh queue (longest job first)
#   drain             take jobs one at a time until the queue is empty; non-zero if any failed
#   django52          Django 5.2 on Python 3.11: the suite without the slow tests, on SQLite
#                     (its own file; django.tasks from the django-tasks backport)
#   django52-browser  the same venv: the admin in a real browser
#   pgbouncer         the durability suites through a private PgBouncer in transaction mode
set -euo pipefail
cd "$(dirname "$0")/.."

queue=.tmp/ci-extra-queue

# The Django 5.2 venv, made once: a second job that needs it waits for the first's pip.
dj52_venv() {
  mkdir -p .tmp
  flock .tmp/ci-extra-dj52.lock \
    scripts/venv.sh .venv-dj52 --python 3.11 -e '.[test]' 'Django>=5.2,<5.3' 'django-tasks'
  .venv-dj52/bin/python -c 'import django, sys; print(f"Django {django.get_version()} on Python {sys.version.split()[0]}")'
}

# The next job's name, taken off the queue under its lock (empty: none left).
next_job() {
  (
    flock 9
    [[ -s $queue ]] || exit 0
    head -n 1 "$queue"
    tail -n +2 "$queue" >"$queue.rest"
    mv "$queue.rest" "$queue"
  ) 9>"$queue.lock"
}

case "${1:-}" in
  queue)
    shift
    mkdir -p .tmp
    printf '%s\n' "$@" >"$queue"
    ;;
  drain)
    failed=0
    while job=$(next_job) && [[ -n $job ]]; do
      started=$SECONDS
      printf '\n==> ci-extra %s\n' "$job"
      status=0
      "$0" "$job" || status=$?
      printf '==> ci-extra %s: exit %s after %ss\n' "$job" "$status" "$((SECONDS - started))"
      [[ $status == 0 ]] || failed=1
    done
    exit "$failed"
    ;;
  django52)
    dj52_venv
    DATABASE_URL="sqlite:///$PWD/.tmp/tests-dj52.sqlite3" \
      .venv-dj52/bin/python -m pytest -p no:cacheprovider -m "not slow"
    ;;
  django52-browser)
    dj52_venv
    DATABASE_URL="sqlite:///$PWD/.tmp/tests-dj52-browser.sqlite3" REQUIRE_BROWSER=1 \
      .venv-dj52/bin/python -m pytest -p no:cacheprovider -m browser
    ;;
  pgbouncer)
    REQUIRE_PGBOUNCER=1 scripts/test-pgbouncer.sh
    ;;
  *)
    echo "usage: scripts/ci-extra.sh queue JOB... | drain | django52 | django52-browser | pgbouncer" >&2
    exit 2
    ;;
esac
