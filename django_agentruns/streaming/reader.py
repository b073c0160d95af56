"""Reading a run's live output: `stream_chunks(run_id)`, sync or async."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .transport import Chunk


class ChunkStream:
    """`stream_chunks(run_id)`: iterate it (`for`) or async-iterate it (`async for`).

    Yields each live chunk (`channel`, `text`, `attempt`, `first`, `end`) from now until
    the run ends; chunks streamed before it was opened are in the run's `stream` events.
    """

    def __init__(self, run_id: int, *, hub: Any = None) -> None:
        self.run_id = run_id
        self._hub = hub

    def _subscribe(self, wake: Callable[[], None]) -> Any:
        from .sse import hub

        # Past any seq: only chunks, and the end, are of interest.
        return (self._hub if self._hub is not None else hub).subscribe(self.run_id, 2**31 - 1, wake)

    def _unsubscribe(self, sub: Any) -> None:
        from .sse import hub

        (self._hub if self._hub is not None else hub).unsubscribe(sub)

    def __iter__(self) -> Iterator[Chunk]:
        ready = threading.Event()
        sub = self._subscribe(ready.set)
        try:
            while True:
                ready.wait(1.0)
                ready.clear()
                found = sub.take()
                if found is None:
                    continue
                yield from found.chunks
                if found.finished:
                    return
        finally:
            self._unsubscribe(sub)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:  # called from the hub's threads
            loop.call_soon_threadsafe(ready.set)

        sub = self._subscribe(wake)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), 1.0)
                ready.clear()
                found = sub.take()
                if found is None:
                    continue
                for chunk in found.chunks:
                    yield chunk
                if found.finished:
                    return
        finally:
            self._unsubscribe(sub)


def stream_chunks(run_id: int) -> ChunkStream:
    """The live chunks of a run, as they are streamed, until it ends (sync or async)."""
    return ChunkStream(run_id)
