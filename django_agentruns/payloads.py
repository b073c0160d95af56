"""A run's input and output read through from its `RunPayload` rows (issue #29's narrow
hot row): `AgentRun.input` and `.output` are properties over these functions, so the run
row that claims and renewals update holds no JSON document.

Each value is read once per instance and kept in its `__dict__`; `load_inputs` reads many
runs' inputs in one query, and the claim statement returns each claimed run's input as
JSON text (`INPUT_JSON`), decoded on first read. A value set on an instance is written by
its next `save()` (`save_payloads`). No import of the models: they import this.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.apps import apps as django_apps

if TYPE_CHECKING:
    from .models import AgentRun

INPUT = "_input"  # where a run instance keeps its read-through input
OUTPUT = "_output"  # ... and its output
INPUT_JSON = "_input_json"  # a claim statement's column: the input as JSON text, or NULL
UNSAVED = "_unsaved_payloads"  # the values set on the instance that save() writes
KINDS = {INPUT: "input", OUTPUT: "output"}
SUCCEEDED = "succeeded"  # Status.SUCCEEDED, without importing the models


def payload_model() -> Any:
    return django_apps.get_model("django_agentruns", "RunPayload")


def input_of(run: AgentRun) -> Any:
    """The run's input: its latest input payload, {} without one (the default input is
    stored as no row)."""
    kept = run.__dict__
    if INPUT not in kept:
        if INPUT_JSON in kept:
            text = kept.pop(INPUT_JSON)
            kept[INPUT] = {} if text is None else json.loads(text)
        elif run.pk is None:
            kept[INPUT] = {}
        else:
            load_inputs([run])
    return kept[INPUT]


def output_of(run: AgentRun) -> Any:
    """What the run returned: its output payload; None without one (None is stored as no
    row). Only a succeeded run has one, so any other costs no query."""
    kept = run.__dict__
    if OUTPUT not in kept:
        kept[OUTPUT] = None
        if run.pk is not None and run.status == SUCCEEDED:
            kept[OUTPUT] = latest(run.pk, "output", run._state.db)
    return kept[OUTPUT]


def latest(run_id: int, kind: str, using: str | None) -> Any:
    return (payload_model()._base_manager.using(using or "default")
            .filter(run_id=run_id, kind=kind).order_by("-id")
            .values_list("value", flat=True).first())


def load_inputs(runs: Iterable[AgentRun], using: str | None = None) -> None:
    """Read the input of each of `runs` not read yet, in one query (the worker's claim
    loop, for the claims whose statement did not return them)."""
    wanted: dict[int, AgentRun] = {}
    for run in runs:
        kept = run.__dict__
        if INPUT in kept:
            continue
        if INPUT_JSON in kept or run.pk is None:
            input_of(run)
        else:
            wanted[run.pk] = run
    if not wanted:
        return
    first = next(iter(wanted.values()))
    found = dict(payload_model()._base_manager.using(using or first._state.db or "default")
                 .filter(run_id__in=list(wanted), kind="input").order_by("id")
                 .values_list("run_id", "value"))  # the latest of a run wins
    for pk, run in wanted.items():
        run.__dict__[INPUT] = found.get(pk, {})


def load_values(runs: Iterable[AgentRun], using: str | None = None) -> None:
    """Read the input and output of each of `runs` not read yet, in one query: for runs
    handed to code that may not query (an async caller of `await_run`)."""
    wanted = {run.pk: run for run in runs if run.pk is not None and (
        INPUT not in run.__dict__ or OUTPUT not in run.__dict__)}
    if not wanted:
        return
    first = next(iter(wanted.values()))
    found = {(pk, kind): value for pk, kind, value in
             payload_model()._base_manager.using(using or first._state.db or "default")
             .filter(run_id__in=list(wanted), kind__in=("input", "output")).order_by("id")
             .values_list("run_id", "kind", "value")}
    for pk, run in wanted.items():
        kept = run.__dict__
        kept.pop(INPUT_JSON, None)
        kept.setdefault(INPUT, found.get((pk, "input"), {}))
        kept.setdefault(OUTPUT, found.get((pk, "output")) if run.status == SUCCEEDED else None)


def outputs_of(run_ids: list[int], using: str | None = None) -> dict[int, Any]:
    """The outputs of these (succeeded) runs, in one query (none for no ids); a run
    without a row (its output was None) is not in the answer."""
    if not run_ids:
        return {}
    return dict(payload_model()._base_manager.using(using or "default")
                .filter(run_id__in=run_ids, kind="output").order_by("id")
                .values_list("run_id", "value"))


def inputs_loaded(run: AgentRun) -> bool:
    return INPUT in run.__dict__ or INPUT_JSON in run.__dict__ or run.pk is None


def set_payload(run: AgentRun, key: str, value: Any) -> None:
    """`run.input = ...` (or output): kept on the instance, written by its next save()."""
    run.__dict__[key] = value
    run.__dict__.setdefault(UNSAVED, set()).add(key)


def keep(run: AgentRun, key: str, value: Any) -> None:
    """The instance's view of a value just written elsewhere: nothing to save."""
    run.__dict__[key] = value
    run.__dict__.get(UNSAVED, set()).discard(key)


def unsaved(run: AgentRun) -> bool:
    return bool(run.__dict__.get(UNSAVED))


def save_payloads(run: AgentRun, using: str, *, adding: bool) -> None:
    """Write the values set on `run` since it was read (its row just saved). A new run's
    default input ({}) and an output of None need no row."""
    from django.utils import timezone

    rows = []
    for key in sorted(run.__dict__.pop(UNSAVED, ())):
        value = run.__dict__[key]
        if adding and value == ({} if key == INPUT else None):
            continue
        rows.append(payload_model()(run_id=run.pk, kind=KINDS[key], value=value,
                                    created_at=timezone.now()))
    if rows:
        payload_model()._base_manager.using(using).bulk_create(rows)
