# `make demo` and `make test` are the two commands the README starts with; both set up
# .venv on first use (newest Python >= 3.11 found) and reinstall only when pyproject changes.

VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= example,postgres,dev

.PHONY: venv demo test test-pgbouncer lint typecheck clean distclean bench

venv:
	@scripts/venv.sh $(VENV) -e '.[$(EXTRAS)]'

# Exits non-zero when a run is left unfinished.
demo: venv
	@$(PY) manage.py migrate --verbosity 0
	@$(PY) manage.py demo

# Extra pytest arguments: make test PYTEST_ARGS='-m "not slow"'
test: venv
	VENV=$(VENV) scripts/test.sh $(PYTEST_ARGS)

# The durability suites again through a private PgBouncer in transaction mode (needs
# Debian's pgbouncer installed; its service is never started).
test-pgbouncer: venv
	VENV=$(VENV) scripts/test-pgbouncer.sh $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .

typecheck: venv
	$(PY) -m mypy django_agentruns

# Side-by-side benchmark against django-tasks-db and procrastinate on PostgreSQL (about
# 15 min; BENCH_ARGS=--quick for a 2-3 min smoke run). Writes bench/results.md.
# BENCH_PG_URL names the server (default postgres://postgres@127.0.0.1:5432).
bench:
	@scripts/venv.sh $(VENV) -e '.[$(EXTRAS),bench]'
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf .tmp .mypy_cache .ruff_cache .pytest_cache build dist *.egg-info artifacts
	rm -f db.sqlite3 db.sqlite3-wal db.sqlite3-shm
	find . -path ./.venv -prune -o -path ./.venv-dj52 -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf .venv .venv-dj52
