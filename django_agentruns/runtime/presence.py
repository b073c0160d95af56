"""The worker's record of itself, kept: register at start, beat, leave at stop.

The SQL of the records is `ops.workers`' (named through the module: one home, patchable).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..db import close_all_connections
from ..ops import workers
from ..ops.workers import Serving

logger = logging.getLogger("django_agentruns.worker")


class Presence:
    """The worker's side: register at start, beat from the lease keeper, leave at stop.

    Every call logs and swallows its database errors: presence is for operators, and a
    worker must not stop serving because its record could not be written. But it closes
    its thread's connections after one: a connection the database killed
    (`pg_terminate_backend`, a failover) stays broken until closed, and the next beat must
    open a fresh one, not fail on the dead one for ever.
    """

    def __init__(self, worker: Serving) -> None:
        self.worker = worker
        self._last = 0.0

    def start(self) -> None:
        self._guard(workers.register, self.worker)
        self._last = time.monotonic()

    def tick(self) -> None:
        if time.monotonic() - self._last < workers.beat_interval():
            return
        self._last = time.monotonic()
        if self._guard(workers.beat, self.worker.worker_id) is False:
            self._guard(workers.register, self.worker)  # pruned while we were away: say so again

    def stop(self) -> None:
        self._guard(workers.unregister, self.worker.worker_id)

    def _guard(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except Exception:
            logger.warning("could not write worker record (%s)", call.__name__, exc_info=True,
                           extra={"worker_id": self.worker.worker_id})
            close_all_connections()  # a dead one would fail every beat after it
            return None
