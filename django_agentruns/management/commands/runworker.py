from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.checks import check_worker_connections, server_max_connections
from django_agentruns.management import logs, reloading
from django_agentruns.management.arguments import (
    non_negative_float,
    port_number,
    positive_int,
    queue_list,
    worker_id,
)
from django_agentruns.ops import metrics
from django_agentruns.registry import all_agents
from django_agentruns.runtime.worker import Worker


class Command(BaseCommand):
    help = "Run agent runs: claim due runs, execute them under a lease, settle them."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--queues", type=queue_list, default=None,
                            help="Comma-separated queues to serve (default: DEFAULT_QUEUE, "
                                 "'default').")
        parser.add_argument("--concurrency", type=positive_int, default=1,
                            help="Attempts run at once (sync in threads, async on a loop; "
                                 "default 1).")
        parser.add_argument("--burst", action="store_true",
                            help="Exit once nothing is due (for scripts and tests; default: "
                                 "serve until stopped).")
        parser.add_argument("--worker-id", type=worker_id, default=None,
                            help="Worker id (default: host:pid:random, unique per start).")
        parser.add_argument("--poll-interval", type=non_negative_float, default=None,
                            help="Seconds an idle worker waits before looking for due runs "
                                 "again (default: POLL_INTERVAL, 1.0); PostgreSQL workers are "
                                 "also woken at once by NOTIFY.")
        parser.add_argument("--reload", action="store_true",
                            help="Development: restart when code changes (Django's "
                                 "autoreloader, as runserver), stopping gracefully first.")
        parser.add_argument("--grace", type=non_negative_float, default=None,
                            help="Seconds attempts get to finish after SIGTERM (default: "
                                 "GRACE, 5.0).")
        parser.add_argument("--metrics-port", type=port_number, default=None,
                            help="Serve Prometheus metrics on this port (0: any free port; "
                                 "needs the `prometheus` extra; default: none).")
        # Loopback by default: the metrics server has no authentication, so exposing it
        # beyond the host (0.0.0.0, a pod IP) is the operator's explicit choice.
        parser.add_argument("--metrics-addr", "--metrics-host", dest="metrics_addr",
                            default=metrics.DEFAULT_ADDR,
                            help=f"Address the metrics server binds (default "
                                 f"{metrics.DEFAULT_ADDR}; 0.0.0.0 for every interface: it "
                                 "has no authentication).")

    def handle(self, *args: Any, **options: Any) -> None:
        logs.configure(options["verbosity"])
        if options["reload"]:
            reloading.run(lambda: self._serve(options))
            return
        self._serve(options)

    def _serve(self, options: dict[str, Any]) -> None:
        try:
            worker = Worker(options["queues"], options["concurrency"], burst=options["burst"],
                            worker_id=options["worker_id"],
                            poll_interval=options["poll_interval"], grace=options["grace"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if options["metrics_port"] is not None:
            try:
                metrics.serve(options["metrics_port"], options["metrics_addr"])
            except metrics.MetricsUnavailable as exc:
                raise CommandError(f"--metrics-port: {exc}") from exc
            except OSError as exc:
                raise CommandError(f"--metrics-port: cannot serve on "
                                   f"{options['metrics_addr']}:{options['metrics_port']}: "
                                   f"{exc}") from exc
        own = worker.connections()
        if options["verbosity"] > 0:
            self.stdout.write(f"worker {worker.worker_id}: concurrency {worker.concurrency}, "
                              f"{own} database connections (writers, claim, lease keeper, "
                              f"listener, live-chunk sender while agents stream), however "
                              f"many attempts run")
        sync_agents = any(not spec.is_async for spec in all_agents().values())
        for warning in check_worker_connections(worker.concurrency, own, sync_agents,
                                                server_max_connections()):
            self.stderr.write(str(warning))
        stats = worker.run() if not options["reload"] else reloading.serve(worker)
        if options["verbosity"] > 0:
            self.stdout.write(f"claimed {stats.claimed} runs; settled {stats.settled or {}}")
        if worker.stuck_attempts:
            # Agent code stuck in a call cannot be interrupted; its run was recorded as
            # abandoned. Leave without waiting for those threads.
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(0)
