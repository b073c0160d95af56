#!/usr/bin/env bash
# CI's two extra lanes, each started by scripts/test.sh when the pass it follows has ended
# (TEST_AFTER_SQLITE / TEST_AFTER_POSTGRES in .ci/run), so they overlap the longer pass
# instead of waiting for both:
#   django52   Django 5.2 on Python 3.11: SQLite not slow, then the admin in a real browser
#              (its own SQLite file; django.tasks from the django-tasks backport)
#   pgbouncer  the durability suites through a private PgBouncer in transaction mode
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  django52)
    scripts/venv.sh .venv-dj52 --python 3.11 -e '.[test]' 'Django>=5.2,<5.3' 'django-tasks'
    .venv-dj52/bin/python -c 'import django, sys; print(f"Django {django.get_version()} on Python {sys.version.split()[0]}")'
    url="sqlite:///$PWD/.tmp/tests-dj52.sqlite3"
    DATABASE_URL=$url .venv-dj52/bin/python -m pytest -p no:cacheprovider -m "not slow"
    DATABASE_URL=$url REQUIRE_BROWSER=1 .venv-dj52/bin/python -m pytest -p no:cacheprovider -m browser
    ;;
  pgbouncer)
    REQUIRE_PGBOUNCER=1 scripts/test-pgbouncer.sh
    ;;
  *)
    echo "usage: scripts/ci-extra.sh django52|pgbouncer" >&2
    exit 2
    ;;
esac
