"""`AgentRunsSaver`: LangGraph's checkpoint saver on this project's tables (history_models).

Inside an agent run, each save is fenced by the run's lease (transitions.graph_checkpoints):
a worker that lost the run saves nothing. Outside one it is a plain saver on the
database. A thread's checkpoints outlive the runs that wrote them, as LangGraph's own
savers keep theirs, until `delete_thread`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from django.db import connection
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)

from ..history_models import GraphCheckpoint, GraphWrite
from ..runtime.context import current_context
from ..transitions import graph_checkpoints as writes_of
from ..transitions.graph_checkpoints import GraphCheckpointPut, GraphWritesPut
from ._bridge import closing_connections

F = TypeVar("F", bound=Callable[..., Any])


def _releasing(method: F) -> F:
    """LangGraph calls a saver from threads of its own, made per graph call: a connection
    Django opens there would outlive its use (and hold a database session). Closed after
    each call, outside a transaction, on any thread but the main one."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            if threading.current_thread() is not threading.main_thread() \
                    and not connection.in_atomic_block:
                connection.close()
    return cast(F, call)


class AgentRunsSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer whose checkpoints are rows of this project's database:
    `builder.compile(checkpointer=AgentRunsSaver())`."""

    # ------------------------------------------------------------------ reads

    @_releasing
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        rows = self._rows(config)
        if checkpoint_id := get_checkpoint_id(config):
            rows = rows.filter(checkpoint_id=checkpoint_id)
        row = rows.order_by("-checkpoint_id").first()
        return None if row is None else self._tuple(row)

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None,
             limit: int | None = None) -> Iterator[CheckpointTuple]:
        rows = GraphCheckpoint.objects.all()
        if config is not None:
            configurable = config["configurable"]
            rows = rows.filter(thread_id=configurable["thread_id"])
            if configurable.get("checkpoint_ns") is not None:
                rows = rows.filter(checkpoint_ns=configurable["checkpoint_ns"])
            if checkpoint_id := get_checkpoint_id(config):
                rows = rows.filter(checkpoint_id=checkpoint_id)
        if before is not None and (before_id := get_checkpoint_id(before)):
            rows = rows.filter(checkpoint_id__lt=before_id)
        for row in _released(list, rows.order_by("thread_id", "checkpoint_ns",
                                                 "-checkpoint_id")):
            found = _released(self._tuple, row)
            if filter and not all(found.metadata.get(k) == v for k, v in filter.items()):
                continue
            if limit is not None:
                if limit <= 0:
                    return
                limit -= 1
            yield found

    # ------------------------------------------------------------------ writes

    @_releasing
    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        configurable = config["configurable"]
        type_, data = self.serde.dumps_typed(checkpoint)
        metadata_type, metadata_data = self.serde.dumps_typed(
            get_checkpoint_metadata(config, metadata))
        ctx = current_context()
        put = GraphCheckpointPut(
            ref=ctx._control.ref if ctx is not None else None,
            thread_id=str(configurable["thread_id"]),
            checkpoint_ns=configurable.get("checkpoint_ns", ""),
            checkpoint_id=checkpoint["id"],
            parent_checkpoint_id=configurable.get("checkpoint_id") or "",
            type=type_, checkpoint=data, metadata_type=metadata_type, metadata=metadata_data)
        self._write(writes_of.put_checkpoint, put)
        return {"configurable": {"thread_id": put.thread_id,
                                 "checkpoint_ns": put.checkpoint_ns,
                                 "checkpoint_id": put.checkpoint_id}}

    @_releasing
    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                   task_id: str, task_path: str = "") -> None:
        configurable = config["configurable"]
        ctx = current_context()
        encoded = []
        for idx, (channel, value) in enumerate(writes):
            type_, data = self.serde.dumps_typed(value)
            encoded.append((WRITES_IDX_MAP.get(channel, idx), channel, type_, data))
        self._write(writes_of.put_writes, GraphWritesPut(
            ref=ctx._control.ref if ctx is not None else None,
            thread_id=str(configurable["thread_id"]),
            checkpoint_ns=configurable.get("checkpoint_ns", ""),
            checkpoint_id=configurable["checkpoint_id"], task_id=task_id,
            task_path=task_path, writes=encoded))

    @_releasing
    def delete_thread(self, thread_id: str) -> None:
        """Forget a thread: its checkpoints and writes (the application's call, as with
        LangGraph's own savers; finished runs' purges keep them)."""
        GraphWrite.objects.filter(thread_id=str(thread_id)).delete()
        GraphCheckpoint.objects.filter(thread_id=str(thread_id)).delete()

    # ------------------------------------------------------------------ async

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        found: CheckpointTuple | None = await self._off_loop(self.get_tuple, config)
        return found

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None,
                    limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        found = await self._off_loop(lambda: list(self.list(config, filter=filter, before=before,
                                                             limit=limit)))
        for item in found:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:
        saved: RunnableConfig = await self._off_loop(self.put, config, checkpoint, metadata,
                                                     new_versions)
        return saved

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str = "") -> None:
        await self._off_loop(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self._off_loop(self.delete_thread, thread_id)

    # ------------------------------------------------------------------ helpers

    def _rows(self, config: RunnableConfig) -> Any:
        configurable = config["configurable"]
        return GraphCheckpoint.objects.filter(
            thread_id=str(configurable["thread_id"]),
            checkpoint_ns=configurable.get("checkpoint_ns", ""))

    def _tuple(self, row: GraphCheckpoint) -> CheckpointTuple:
        where = {"thread_id": row.thread_id, "checkpoint_ns": row.checkpoint_ns}
        pending = sorted(GraphWrite.objects.filter(**where, checkpoint_id=row.checkpoint_id),
                         key=lambda w: writes_sort_key(w.task_path, w.task_id, w.idx))
        return CheckpointTuple(
            config={"configurable": {**where, "checkpoint_id": row.checkpoint_id}},
            checkpoint=self.serde.loads_typed((row.type, bytes(row.checkpoint))),
            metadata=self.serde.loads_typed((row.metadata_type, bytes(row.metadata))),
            parent_config=({"configurable": {**where,
                                             "checkpoint_id": row.parent_checkpoint_id}}
                           if row.parent_checkpoint_id else None),
            pending_writes=[(w.task_id, w.channel,
                             self.serde.loads_typed((w.type, bytes(w.value))))
                            for w in pending])

    @staticmethod
    def _write(func: Any, put: Any) -> None:
        """Inside a run: through the attempt's storage call (retried while the database is
        out of reach) and its fence; a lost lease or a cancel stops the attempt here."""
        ctx = current_context()
        if ctx is None:
            func(put)
            return
        ctx._control.apply(ctx._control.call(func, put))

    @staticmethod
    async def _off_loop(func: Any, *args: Any) -> Any:
        """The ORM off the event loop, in this context (the run's, for the fence)."""
        return await asyncio.to_thread(closing_connections, func, *args)


@_releasing
def _released(func: Callable[..., Any], *args: Any) -> Any:
    return func(*args)
