"""The status guard of an UPDATE that finds its rows by id, written so that the planner
finds them by id.

A plain `status = 'queued'` beside `id IN (...)` matches the predicate of every partial
index of queued runs, and when the table's statistics predate the backlog (PostgreSQL
re-analyzes a table of millions only after a tenth of it changes) the planner scans one
of those indexes whole for a handful of ids. `(status = 'queued') IS TRUE` is the same
test for a column that is never NULL, and no partial index's predicate matches it.
"""

from __future__ import annotations

from django.db.models import BooleanField, Func, Q


def still(status: str) -> Func:
    """A filter: the row's status is still `status` (the compare-and-set's guard)."""
    return Func(Q(status=status), template="(%(expressions)s) IS TRUE",
                output_field=BooleanField())


def still_sql(table: str) -> str:
    """`still` in raw SQL, for `table` (quoted): the status is the statement's next
    parameter."""
    return f"({table}.status = %s) IS TRUE"
