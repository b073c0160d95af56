"""SIGTERM and SIGINT stop a worker gracefully; a second one exits at once; SIGUSR1 prints
every thread's stack.

A signal handler runs in the main thread between any two bytecodes, maybe while that
thread holds an Event's lock (the claim loop clears and waits on its wake-up Event);
stopping the worker from the handler (which sets Events) would then wait on that lock
forever. So the handler only writes a byte to a pipe, and a thread of its own reads it
and stops the worker.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

logger = logging.getLogger("django_agentruns.worker")


class StopSignals:
    def __init__(self, stop: Callable[[], None], grace: float, worker_id: str) -> None:
        self.stop = stop
        self.grace = grace
        self.worker_id = worker_id
        self.received = 0
        self._write_fd = -1

    def install(self) -> None:
        """In the main thread (Python delivers signals there)."""
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        threading.Thread(target=self._watch, args=(read_fd,), name="agentruns-signals",
                         daemon=True).start()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # `kill -USR1 <pid>`: every thread's stack to stderr, for a worker that seems stuck.
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def _watch(self, read_fd: int) -> None:
        signum = os.read(read_fd, 1)[0]
        logger.info("signal %s: stopping (grace %.1fs)", signal.Signals(signum).name,
                    self.grace, extra={"worker_id": self.worker_id})
        self.stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Only what is safe wherever the main thread was: a count, a byte, a log line
        (logging's locks are reentrant), or an exit."""
        self.received += 1
        if self.received > 1:
            # A second signal: leave now. Leases lapse and the runs are reclaimed.
            logger.warning("second signal: exiting at once", extra={"worker_id": self.worker_id})
            os._exit(1)
        os.write(self._write_fd, bytes([signum]))
