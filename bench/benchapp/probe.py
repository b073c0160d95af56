"""What the bench agents and worker processes record about themselves.

`record_start` is called first thing by the latency agents of every engine: it appends
`<token> <t_enqueue> <t_start>` to the file named by ``BENCH_LATENCY_FILE`` (one short
O_APPEND write per run, so concurrent workers do not interleave lines).

`count_statements` counts the SQL statements a process sends through psycopg (Django's
backend and procrastinate's own pool both use it) and writes the total at exit. It wraps
the cursor's execute methods, so it sees every engine the same way, with no server
extension needed.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any


def record_start(payload: Mapping[str, Any]) -> None:
    started = time.time()
    path = os.environ.get("BENCH_LATENCY_FILE")
    if not path:
        return
    line = f"{payload['token']} {payload['t0']:.6f} {started:.6f}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


_counter = itertools.count()  # next() is atomic under the GIL: threads may share it


def count_statements(path: str) -> None:
    import psycopg

    def wrap_sync(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            next(_counter)
            return method(self, *args, **kwargs)

        return run

    def wrap_async(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            next(_counter)
            return await method(self, *args, **kwargs)

        return run

    # ClientCursor and the async client cursor inherit these; server cursors go unused.
    for cls in (psycopg.Cursor,):
        for name in ("execute", "executemany"):
            if name in vars(cls):
                setattr(cls, name, wrap_sync(vars(cls)[name]))
    for cls in (psycopg.AsyncCursor,):
        for name in ("execute", "executemany"):
            if name in vars(cls):
                setattr(cls, name, wrap_async(vars(cls)[name]))

    def write() -> None:
        total = next(_counter)  # one past the count
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {total}\n")

    atexit.register(write)
