from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.management.arguments import non_negative_float, positive_int, queue_list
from django_agentruns.worker import Worker


class Command(BaseCommand):
    help = "Run agent runs: claim due runs, execute them under a lease, settle them."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--queues", type=queue_list, default=None,
                            help="Comma-separated queues to serve (default: DEFAULT_QUEUE).")
        parser.add_argument("--concurrency", type=positive_int, default=1,
                            help="Attempts run at once (sync in threads, async on a loop).")
        parser.add_argument("--burst", action="store_true",
                            help="Exit once nothing is due (for scripts and tests).")
        parser.add_argument("--worker-id", default=None,
                            help="Worker id (default: host:pid:random, unique per start).")
        parser.add_argument("--poll-interval", type=non_negative_float, default=None)
        parser.add_argument("--grace", type=non_negative_float, default=None,
                            help="Seconds attempts get to finish after SIGTERM (default 5).")

    def handle(self, *args: Any, **options: Any) -> None:
        logging.getLogger("django_agentruns").setLevel(
            logging.DEBUG if options["verbosity"] > 2 else logging.INFO)
        if not logging.getLogger("django_agentruns").handlers and \
                not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO,
                                format="%(asctime)s %(levelname)s %(name)s %(message)s")
        try:
            worker = Worker(options["queues"], options["concurrency"], burst=options["burst"],
                            worker_id=options["worker_id"],
                            poll_interval=options["poll_interval"], grace=options["grace"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        stats = worker.run()
        if options["verbosity"] > 0:
            self.stdout.write(f"claimed {stats.claimed} runs; settled {stats.settled or {}}")
        if worker.stuck_attempts:
            # Agent code stuck in a call cannot be interrupted; its run was recorded as
            # abandoned. Leave without waiting for those threads.
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(0)
