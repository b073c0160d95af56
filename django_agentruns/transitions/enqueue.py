"""New runs: one INSERT for any number of them (enqueue is transactional)."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from django.db import connection, transaction

from ..conf import app_settings
from ..models import AgentRun, Status
from . import rawsql


class NewRun(NamedTuple):
    """A checked run to queue (`api` builds them): what differs from one new run to another."""

    agent: str
    queue: str
    priority: int
    scope: str
    fired_seq: int
    input: Any
    input_json: str  # `input` as the JSON text to store
    max_requeues: int
    available_at: datetime
    limit_key: str = ""  # resolved by api (django_agentruns.limits)


# What each element of insert_runs' JSON array holds, in order (input as its JSON text).
_PER_RUN = ("agent", "queue", "priority", "scope", "fired_seq", "input", "max_requeues",
            "available_at", "limit_key")


# The rows travel as one JSON text per statement, and PostgreSQL takes at most 255 MB of
# jsonb in one value: larger batches are written in several statements of at most this.
MAX_STATEMENT_BYTES = 64 * 1024 * 1024


def insert_runs(new: Sequence[NewRun], at: datetime) -> list[AgentRun]:
    """Queue `new` runs created `at` in one INSERT; return them saved, in the same order.

    One statement, so it needs no transaction of its own: in the caller's it stands or falls
    with it (enqueue is transactional), in autocommit it is all or nothing by itself.
    The rows travel as one JSON array that the database unpacks: no Python per field and
    row (bulk_create's cost), one parameter whatever the count (SQLite's limit on them
    never applies), and one short plan. Ids are drawn in array order, so the RETURNING
    ids, sorted, are the rows' in order. Rows too large for one statement go in several,
    in one transaction: still all or nothing.
    """
    at_text = _json_time(at)
    rows = [[r.agent, r.queue, r.priority, r.scope, r.fired_seq, r.input_json, r.max_requeues,
             at_text if r.available_at is at else _json_time(r.available_at), r.limit_key]
            for r in new]
    # Escaping at most doubles a row's text: below half the cap, one statement surely does.
    if sum(len(r.input_json) + 1000 for r in new) * 2 <= MAX_STATEMENT_BYTES:
        ids = _insert(json.dumps(rows), at)
    else:
        with transaction.atomic():
            ids = [pk for chunk in _chunks(rows) for pk in _insert(chunk, at)]
    fields = AgentRun._meta.concrete_fields
    names, alias = [f.attname for f in fields], connection.alias
    shared = {f.attname: f.get_default() for f in fields}
    shared.update(status=Status.QUEUED, created_at=at)
    runs = []
    for r, pk in zip(new, ids, strict=True):
        values = {**shared, **r._asdict(), "id": pk}
        runs.append(AgentRun.from_db(alias, names, [values[n] for n in names]))
    return runs


def _insert(rows: str, at: datetime) -> list[int]:
    """One INSERT of the JSON array `rows`; the new ids in array order."""
    sql, fixed = _insert_statement(connection.vendor)
    with rawsql.cursor(prepared=bool(app_settings.PREPARED_STATEMENTS)) as cursor:
        cursor.execute(sql, [*fixed, connection.ops.adapt_datetimefield_value(at), rows])
        return sorted(pk for (pk,) in cursor.fetchall())


def _chunks(rows: list[list[Any]]) -> list[str]:
    """`rows` as JSON arrays of at most MAX_STATEMENT_BYTES each (a larger row alone)."""
    chunks: list[str] = []
    texts: list[str] = []
    size = 0
    for row in rows:
        text = json.dumps(row)
        if texts and size + len(text) > MAX_STATEMENT_BYTES:
            chunks.append(f"[{','.join(texts)}]")
            texts, size = [], 0
        texts.append(text)
        size += len(text) + 1
    chunks.append(f"[{','.join(texts)}]")
    return chunks


def _json_time(value: datetime) -> str:
    """A datetime as the JSON rows carry it: text the database reads as that instant."""
    return str(connection.ops.adapt_datetimefield_value(value.astimezone(UTC)))


@functools.cache
def _insert_statement(vendor: str) -> tuple[str, tuple[Any, ...]]:
    """insert_runs' INSERT, and the values of its fixed columns: status 'queued' and every
    other NOT NULL column at its (constant) model default. Then created_at and the rows
    are the parameters; nullable columns are left NULL."""
    fields = {f.attname: f for f in AgentRun._meta.concrete_fields}
    fixed = {name: Status.QUEUED if name == "status" else f.get_default()
             for name, f in fields.items()
             if name not in (*_PER_RUN, "created_at") and not f.primary_key and not f.null}
    qn = connection.ops.quote_name
    if vendor == "postgresql":
        # Cast to the column's type without its length: a value too long is an error, not cut.
        picks = [f"(r->>{i})::{str(fields[name].db_type(connection)).split('(')[0]}"
                 for i, name in enumerate(_PER_RUN)]
        source = "jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS rows(r, n) ORDER BY n"
    else:
        picks = [f"json_extract(value, '$[{i}]')" for i in range(len(_PER_RUN))]
        source = "json_each(%s) ORDER BY key"
    columns = ", ".join(qn(str(fields[name].column))
                        for name in (*_PER_RUN, *fixed, "created_at"))
    values = ", ".join([*picks, *["%s"] * (len(fixed) + 1)])
    sql = (f"INSERT INTO {qn(AgentRun._meta.db_table)} ({columns}) SELECT {values} "
           f"FROM {source} RETURNING {qn(str(AgentRun._meta.pk.column))}")
    return sql, tuple(fields[name].get_db_prep_save(value, connection)
                      for name, value in fixed.items())
