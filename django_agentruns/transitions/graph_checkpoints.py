"""The writes of LangGraph's checkpoint saver, fenced by the run that makes them.

Inside a run, a checkpoint (or a task's pending writes) is saved in one transaction with
the attempt's lease renewal: a worker that lost the run saves nothing, so a graph the
reaper handed to another worker has one writer. Outside a run (`ref` None), unfenced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from ..db import retry_on_lock
from ..history_models import GraphCheckpoint, GraphWrite
from ..outcomes import AttemptRef, Renewal
from .attempts import _renew_locked
from .events import now


@dataclass(frozen=True)
class GraphCheckpointPut:
    ref: AttemptRef | None
    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_checkpoint_id: str
    type: str
    checkpoint: bytes
    metadata_type: str
    metadata: bytes


@dataclass(frozen=True)
class GraphWritesPut:
    """A task's writes: (idx, channel, type, value) each; a negative idx (LangGraph's
    errors, interrupts) replaces the one stored, others are kept if already there."""

    ref: AttemptRef | None
    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    task_id: str
    task_path: str
    writes: Sequence[tuple[int, str, str, bytes]]


def _fence(ref: AttemptRef | None) -> Renewal:
    return Renewal.OK if ref is None else _renew_locked(ref, now())


@retry_on_lock()
def put_checkpoint(put: GraphCheckpointPut) -> Renewal:
    with transaction.atomic():
        renewal = _fence(put.ref)
        if renewal is Renewal.LOST:
            return renewal
        GraphCheckpoint.objects.update_or_create(
            thread_id=put.thread_id, checkpoint_ns=put.checkpoint_ns,
            checkpoint_id=put.checkpoint_id,
            defaults={"parent_checkpoint_id": put.parent_checkpoint_id, "type": put.type,
                      "checkpoint": put.checkpoint, "metadata_type": put.metadata_type,
                      "metadata": put.metadata,
                      "run_id": put.ref.run_id if put.ref is not None else None})
        return renewal


@retry_on_lock()
def put_writes(put: GraphWritesPut) -> Renewal:
    with transaction.atomic():
        renewal = _fence(put.ref)
        if renewal is Renewal.LOST:
            return renewal
        where: dict[str, Any] = {"thread_id": put.thread_id, "checkpoint_ns": put.checkpoint_ns,
                 "checkpoint_id": put.checkpoint_id, "task_id": put.task_id}
        kept = []
        for idx, channel, type_, value in put.writes:
            fields = {"channel": channel, "type": type_, "value": value,
                      "task_path": put.task_path}
            if idx < 0:
                GraphWrite.objects.update_or_create(**where, idx=idx, defaults=fields)
            else:
                kept.append(GraphWrite(**where, idx=idx, **fields))
        GraphWrite.objects.bulk_create(kept, ignore_conflicts=True)
        return renewal
