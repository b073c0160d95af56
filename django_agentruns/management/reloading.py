"""`runworker --reload`: Django's autoreloader around a worker, for development.

As `runserver` does, a parent process restarts a child whenever a loaded module's file
changes; in the child the worker runs on the reloader's "main" thread. A change first stops
the worker gracefully (attempts get the grace period, leases are released, its record is
removed), then lets the reloader restart the process, which starts a worker with the new code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.utils import autoreload

from django_agentruns.runtime.worker import Worker, WorkerStats

logger = logging.getLogger("django_agentruns.worker")
STOP_MARGIN = 5.0  # seconds beyond the grace period a reload waits for the worker


def run(main: Callable[[], None]) -> None:
    autoreload.run_with_reloader(main)


def serve(worker: Worker) -> WorkerStats:
    """Run `worker` until a code change (or a stop); a change stops it before the reload."""
    stopped = threading.Event()

    def on_change(sender: Any, file_path: Path, **kwargs: Any) -> None:
        logger.info("%s changed: stopping the worker, then reloading", file_path,
                    extra={"worker_id": worker.worker_id})
        worker.stop()
        stopped.wait(worker.grace + STOP_MARGIN)
        # Returning None (not True) lets the reloader restart the process.

    autoreload.file_changed.connect(on_change, weak=False)
    try:
        # Not the process's main thread: the reloader keeps that (and its signals).
        return worker.run(install_signals=False)
    finally:
        stopped.set()
        autoreload.file_changed.disconnect(on_change)
