"""New runs: one INSERT for any number of them (enqueue is transactional), and forks."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from django.db import DEFAULT_DB_ALIAS, OperationalError, connection, connections, transaction

from .. import partitioning
from ..conf import app_settings
from ..models import AgentLimit, AgentRun, RunPayload, Status
from ..payloads import INPUT, keep
from . import rawrows, rawsql
from .fair import join_groups, stamp_base_sql, stamp_offsets, stamping
from .windows import give_pattern_keys_rows


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
    dedupe_key: str = ""  # "": none; else an unfinished run of the agent with it is returned
    limit_key: str = ""  # resolved by api (django_agentruns.rules.limits)
    # Failover (django_agentruns.rules.limits): the run takes the first of them that is open.
    limit_keys: tuple[str, ...] = ()
    agent_version: int = 1  # the agent's version the run starts under
    fair_key: str = ""  # its fairness group (django_agentruns.rules.fairness); "": none


# What each element of insert_runs' JSON array holds, in order (input as its JSON text).
_PER_RUN = ("agent", "queue", "priority", "scope", "fired_seq", "input", "max_requeues",
            "available_at", "dedupe_key", "limit_key", "agent_version", "fair_key")
# Then each row's fair-share stride and offset in its group (transitions.fair.stamp_offsets).
STRIDE_AT, OFFSET_AT = len(_PER_RUN), len(_PER_RUN) + 1
QUEUE_AT, KEY_AT, PRIORITY_AT = (_PER_RUN.index(n) for n in ("queue", "fair_key", "priority"))
EMPTY_INPUT = "{}"  # the default input's JSON text: stored as no payload row
# A dedupe key taken by a run that finished before its holder could be read: insert again,
# at most this many times (each round needs another run to finish at that very moment).
DEDUPE_ROUNDS = 5


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

    A row with a dedupe key that an unfinished run of its agent holds is not inserted
    (ON CONFLICT DO NOTHING against the partial unique index `agentruns_dedupe`, which
    waits for a concurrent insert of the same key to commit or roll back): that run is
    read and returned in its place, with `deduplicated` True.
    """
    new = pick_open_keys(new, at)
    give_pattern_keys_rows({r.limit_key for r in new}, at)
    fair = {(r.queue, r.fair_key) for r in new if r.fair_key}
    if fair and not connection.in_atomic_block:
        # The groups' rows stay locked until the runs are in (transitions.fair.join_groups).
        with transaction.atomic():
            join_groups(fair)
            return _insert_placed(new, at)
    join_groups(fair)
    return _insert_placed(new, at)


def _insert_placed(new: Sequence[NewRun], at: datetime) -> list[AgentRun]:
    if connection.vendor != "postgresql" and not connection.in_atomic_block and \
            any(r.input_json != EMPTY_INPUT for r in new):
        with transaction.atomic():  # the runs and their inputs' rows: two statements here
            return _insert_placed(new, at)
    runs: list[AgentRun | None] = [None] * len(new)
    pending = list(range(len(new)))
    for _ in range(DEDUPE_ROUNDS):
        inserted = _insert_rows([new[i] for i in pending], at)
        pending = _place(new, pending, inserted, at, runs)
        if not pending:
            store_failover_keys([(r, n.limit_keys) for r, n in zip(runs, new, strict=True)])
            return [r for r in runs if r is not None]
    raise OperationalError("dedupe keys kept changing hands while enqueueing; try again")


def pick_open_keys(new: Sequence[NewRun], at: datetime) -> Sequence[NewRun]:
    """Each run with failover keys takes the first that is not closed at `at` (all closed:
    the first). One read of the limits table, only when a run has more than one key."""
    listed = {k for r in new if len(r.limit_keys) > 1 for k in r.limit_keys}
    closed = set(AgentLimit.objects.filter(key__in=sorted(listed), closed_until__gt=at)
                 .values_list("key", flat=True)) if listed else set()

    def pick(r: NewRun) -> NewRun:
        if not r.limit_keys:
            return r
        key = next((k for k in r.limit_keys if k not in closed), r.limit_keys[0])
        return r._replace(limit_key=key)

    return [pick(r) for r in new]


def store_failover_keys(placed: list[tuple[AgentRun | None, tuple[str, ...]]]) -> None:
    """The failover list of each new run that has one (deduplicated runs keep theirs)."""
    for run, keys in placed:
        if run is not None and len(keys) > 1 and not run.deduplicated:
            AgentRun.objects.filter(pk=run.pk).update(limit_keys=list(keys))


Inserted = tuple[int, str, str, float]  # id, agent, dedupe_key, fair_vstart


def _insert_rows(rows: Sequence[NewRun], at: datetime) -> list[Inserted]:
    """INSERT `rows`; (id, agent, dedupe_key, stamp) of those inserted, in array order."""
    at_text = _json_time(at)
    data = [[r.agent, r.queue, r.priority, r.scope, r.fired_seq, r.input_json, r.max_requeues,
             at_text if r.available_at is at else _json_time(r.available_at), r.dedupe_key,
             r.limit_key, r.agent_version, r.fair_key]
            for r in rows]
    stamped = stamping(r.fair_key for r in rows)
    # Escaping at most doubles a row's text: below half the cap, one statement surely does.
    if sum(len(r.input_json) + 1000 for r in rows) * 2 <= MAX_STATEMENT_BYTES:
        shape, extra = _shape(rows, stamped)
        if shape == ONE_INPUT:  # the input travels as its own parameter, not twice
            data[0][_PER_RUN.index("input")] = None
        return _insert(json.dumps(_stamped(data) if stamped else data), at, shape, extra)
    with transaction.atomic():  # each chunk's stamps follow those of the chunks before it
        shape = STAMPED if stamped else DRAWN
        return [row for chunk in _chunks(data, stamped) for row in _insert(chunk, at, shape)]


# The INSERT's shapes on PostgreSQL (`_insert_statement`); elsewhere one statement does all.
PLAIN = "plain"  # no input to write and no stamps: the INSERT alone
ONE_INPUT = "one"  # one run with an input: its payload row from the INSERT's RETURNING
DRAWN = "drawn"  # ids drawn first, so each inserted row's input is found by its id
STAMPED = "stamped"  # DRAWN, and each run's fair-share stamp


def _shape(rows: Sequence[NewRun], stamped: bool) -> tuple[str, list[str]]:
    """The INSERT's shape for `rows`, and the parameters it takes after the others: the
    cheapest statement that writes what these rows need (a run's default input is no row,
    so most enqueues need no payload part at all)."""
    if stamped:
        return STAMPED, []
    inputs = [r.input_json for r in rows if r.input_json != EMPTY_INPUT]
    if not inputs:
        return PLAIN, []
    if len(rows) == 1:
        return ONE_INPUT, inputs
    return DRAWN, []


def _stamped(data: list[list[Any]]) -> list[list[Any]]:
    """`data`'s rows with their fair-share stride and offset appended (transitions.fair)."""
    groups = [(row[QUEUE_AT], row[KEY_AT], row[PRIORITY_AT]) for row in data]
    return [[*row, stride, offset]
            for row, (stride, offset) in zip(data, stamp_offsets(groups), strict=True)]


def _place(new: Sequence[NewRun], pending: list[int], inserted: list[Inserted],
           at: datetime, runs: list[AgentRun | None]) -> list[int]:
    """Fill `runs` at the `pending` positions from what the INSERT returned, and each skipped
    row with the run holding its key; the positions still without a run (its holder
    finished meanwhile) are returned, to insert again."""
    by_key = {(agent, key): pk for pk, agent, key, _ in inserted if key}
    keyless = iter(pk for pk, _, key, _ in inserted if not key)
    stamps = {pk: stamp for pk, _, _, stamp in inserted}
    names, constant, per_run = _new_row_shape()
    alias = connection.alias
    make = rawrows.run_maker(alias, names)
    shared = {**constant, "created_at": at}
    taken: set[int] = set()
    again = []
    inputs: list[tuple[int, str]] = []  # SQLite: (id, input JSON) of the runs inserted
    for i in pending:
        r = new[i]
        pk = by_key.get((r.agent, r.dedupe_key)) if r.dedupe_key else next(keyless)
        if pk is not None and pk not in taken:
            taken.add(pk)
            values = dict(zip(per_run, r, strict=True))
            values.update(shared, id=pk, fair_vstart=stamps[pk],
                          limit_keys=list(r.limit_keys) if len(r.limit_keys) > 1 else None)
            runs[i] = run = make(values)
            keep(run, INPUT, r.input)
            if r.input_json != EMPTY_INPUT:
                inputs.append((pk, r.input_json))
            continue
        # An earlier row of this call holds the key, or an unfinished run does.
        if pk is None:
            existing = AgentRun.objects.holding_key(r.agent, r.dedupe_key).first()
        else:
            existing = next(x for x in runs if x is not None and x.pk == pk)
            existing = AgentRun.from_db(alias, names, [getattr(existing, n) for n in names])
        if existing is None:
            again.append(i)
            continue
        existing.deduplicated = True
        runs[i] = existing
    if inputs and connection.vendor != "postgresql":  # PostgreSQL: in the runs' INSERT
        insert_inputs(inputs, at)
    return again


@functools.cache
def _new_row_shape() -> tuple[list[str], dict[str, Any], tuple[str, ...]]:
    """For the runs `_place` builds: the model's attnames in order, the values every new
    run has (its fields' constant defaults, status queued; created_at is the call's), and
    NewRun's fields that are the model's, in NewRun's order."""
    fields = AgentRun._meta.concrete_fields
    names = [f.attname for f in fields]
    per_run = tuple(n if n in names else "" for n in NewRun._fields)
    constant = {f.attname: f.get_default() for f in fields
                if not (f.has_default() and callable(f.default)) and f.attname not in per_run}
    constant.update(status=Status.QUEUED, forked_from_id=None)
    missing = [n for n in names if n not in constant and n not in per_run
               and n not in ("id", "created_at", "fair_vstart", "limit_keys")]
    assert not missing, f"new runs' fields without a value: {missing}"
    return names, constant, per_run


def insert_inputs(inputs: Sequence[tuple[int, str]], at: datetime) -> None:
    """The input payload rows of new runs ((id, input JSON text)), in one INSERT."""
    table = connection.ops.quote_name(RunPayload._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (run_id, kind, value, created_at) "
            f"SELECT json_extract(value, '$[0]'), %s, json_extract(value, '$[1]'), %s "
            f"FROM json_each(%s)",
            [RunPayload.INPUT, connection.ops.adapt_datetimefield_value(at),
             json.dumps(inputs)])


def _insert(rows: str, at: datetime, shape: str, extra: Sequence[str] = ()) -> list[Inserted]:
    """One INSERT of the JSON array `rows` in `shape` (STAMPED: with their fair-share
    strides and offsets, whose stamps it writes; ONE_INPUT: `extra` holds the input);
    (id, agent, dedupe_key, stamp) of the rows inserted, in array order."""
    db = connections[DEFAULT_DB_ALIAS]
    postgres = db.vendor == "postgresql"
    sql, fixed = _insert_statement(db.vendor, shape if postgres else
                                   STAMPED if shape == STAMPED else PLAIN)
    created = db.ops.adapt_datetimefield_value(at)
    if not postgres or shape == PLAIN:
        params = [*fixed, created, rows]
    elif shape == ONE_INPUT:
        params = [*fixed, created, rows, *extra, created]
    else:
        params = [rows, *fixed, created, created]
    for tries_left in (1, 0):
        try:
            with rawrows.cursor(prepared=bool(app_settings.PREPARED_STATEMENTS)) as cursor:
                cursor.execute(sql, params)
                found = sorted(cursor.fetchall())
            break
        except Exception as exc:
            # Partitioned history: the inputs' payload rows went past the partitions made
            # so far (no worker ran `ensure` lately). Outside a transaction, make them and
            # insert again; inside one, the caller's transaction is already aborted.
            if not tries_left or db.in_atomic_block or not partitioning.no_partition(exc):
                raise
            partitioning.make_room()
    if found:
        partitioning.keep_ahead(found[-1][0])
    return found


def _chunks(rows: list[list[Any]], stamped: bool) -> list[str]:
    """`rows` as JSON arrays of at most MAX_STATEMENT_BYTES each (a larger row alone), each
    chunk's rows stamped on their own (if `stamped`)."""
    chunks: list[list[list[Any]]] = []
    chunk: list[list[Any]] = []
    size = 0
    for row in rows:
        length = len(json.dumps(row)) + 40  # and its stride and offset
        if chunk and size + length > MAX_STATEMENT_BYTES:
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(row)
        size += length + 1
    chunks.append(chunk)
    return [json.dumps(_stamped(c) if stamped else c) for c in chunks]


def _json_time(value: datetime) -> str:
    """A datetime as the JSON rows carry it: text the database reads as that instant."""
    return rawsql.db_time(value)


@functools.cache
def _insert_statement(vendor: str, shape: str) -> tuple[str, tuple[Any, ...]]:
    """insert_runs' INSERT in `shape`, and the values of its fixed columns: status 'queued'
    and every other NOT NULL column at its (constant) model default. Nullable columns are
    left NULL. Elsewhere than on PostgreSQL the shape is PLAIN or STAMPED.

    The input is no column (`RunPayload`); on PostgreSQL the statement writes the input
    payload rows too. PLAIN (no run has one): the INSERT alone. ONE_INPUT: one run, its
    input a parameter of its own, its row made from the INSERT's RETURNING. DRAWN: the ids
    are drawn from the run table's sequence in array order before the INSERT, so each
    inserted row's input is found by its id. STAMPED: DRAWN, and it writes each run's
    fair-share stamp (transitions.fair); the other shapes leave the column's default."""
    stamped = shape == STAMPED
    fields = {f.attname: f for f in AgentRun._meta.concrete_fields}
    columns_of = [name for name in _PER_RUN if name != "input"]
    fixed = {name: Status.QUEUED if name == "status" else f.get_default()
             for name, f in fields.items()
             if name not in (*_PER_RUN, "created_at", "fair_vstart") and not f.primary_key
             and not f.null}
    qn = connection.ops.quote_name
    runs = qn(AgentRun._meta.db_table)
    at_input = _PER_RUN.index("input")
    rows = "jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS rows(r, n)"
    if vendor == "postgresql":
        # Cast to the column's type without its length: a value too long is an error, not cut.
        picks = [f"(r->>{_PER_RUN.index(name)})::"
                 f"{str(fields[name].db_type(connection)).split('(')[0]}"
                 for name in columns_of]
        source = "src ORDER BY n" if shape in (DRAWN, STAMPED) else f"{rows} ORDER BY n"
        if stamped:  # each group's first stamp once (stamp_base_sql), then each row's offset
            picks.append(f"base.b + (r->>{OFFSET_AT})::float8")
            source = (f"src JOIN base ON base.q = r->>{QUEUE_AT} AND base.k = r->>{KEY_AT} "
                      f"AND base.p = (r->>{PRIORITY_AT})::int ORDER BY n")
    else:
        picks = [f"json_extract(value, '$[{_PER_RUN.index(name)}]')" for name in columns_of]
        # The SELECT reads the run table, so SQLite runs it to the end before inserting: a
        # row's stamp never sees another of the same statement.
        item = "json_extract(json_each.value, '$[{}]')".format
        if stamped:
            base = stamp_base_sql(vendor, item(QUEUE_AT), item(KEY_AT), item(PRIORITY_AT),
                                  item(STRIDE_AT))
            picks.append(f"{base} + {item(OFFSET_AT)}")
        # WHERE true: SQLite needs a WHERE in an INSERT ... SELECT with an upsert clause.
        source = "json_each(%s) WHERE true ORDER BY key"
    columns = ", ".join(qn(str(fields[name].column))
                        for name in (*columns_of, *(["fair_vstart"] if stamped else []), *fixed,
                                     "created_at"))
    values = ", ".join([*picks, *["%s"] * (len(fixed) + 1)])
    returning = (f"{qn(str(AgentRun._meta.pk.column))}, {qn('agent')}, {qn('dedupe_key')}, "
                 f"{qn('fair_vstart')}")
    drawn = shape in (DRAWN, STAMPED) and vendor == "postgresql"
    id_ = "id, " if drawn else ""
    insert = (f"INSERT INTO {runs} ({id_}{columns}) SELECT {id_}{values} "
              f"FROM {source} ON CONFLICT DO NOTHING RETURNING {returning}")
    payloads = (f"INSERT INTO {qn(RunPayload._meta.db_table)} (run_id, kind, value, "
                f"created_at) SELECT ins.id, '{RunPayload.INPUT}', ")
    if drawn:
        sequence = f"(SELECT pg_get_serial_sequence('{AgentRun._meta.db_table}', 'id'))"
        sql = (f"WITH src AS MATERIALIZED (SELECT nextval({sequence}::regclass) AS id, r, n "
               f"FROM {rows}), "
               + (f"base AS MATERIALIZED (SELECT g.q, g.k, g.p, "
                  f"{stamp_base_sql(vendor, 'g.q', 'g.k', 'g.p', 'g.s')} AS b FROM (SELECT "
                  f"DISTINCT r->>{QUEUE_AT} AS q, r->>{KEY_AT} AS k, (r->>{PRIORITY_AT})::int "
                  f"AS p, (r->>{STRIDE_AT})::float8 AS s FROM src) g), " if stamped else "")
               + f"ins AS ({insert}), "
               f"pay AS ({payloads}(src.r->>{at_input})::jsonb, %s FROM ins JOIN src ON "
               f"src.id = ins.id WHERE src.r->>{at_input} <> '{EMPTY_INPUT}') "
               f"SELECT * FROM ins")
    elif shape == ONE_INPUT and vendor == "postgresql":
        sql = f"WITH ins AS ({insert}), pay AS ({payloads}%s::jsonb, %s FROM ins) SELECT * FROM ins"
    else:
        sql = insert
    return sql, tuple(fields[name].get_db_prep_save(value, connection)
                      for name, value in fixed.items())
