from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.checks import check_worker_connections, server_max_connections
from django_agentruns.conf import app_settings
from django_agentruns.exceptions import InvalidInputError
from django_agentruns.management import logs, reloading
from django_agentruns.management.arguments import (
    non_negative_float,
    port_number,
    positive_int,
    queue_list,
    worker_id,
)
from django_agentruns.ops import metrics
from django_agentruns.registry import all_agents, check_worker_names
from django_agentruns.runtime.supervisor import Supervisor
from django_agentruns.runtime.worker import Worker

MOST_PROCESSES = 256


class Command(BaseCommand):
    help = "Run agent runs: claim due runs, execute them under a lease, settle them."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--queues", type=queue_list, default=None,
                            help="Comma-separated queues to serve (default: DEFAULT_QUEUE, "
                                 "'default').")
        parser.add_argument("--concurrency", type=positive_int, default=1,
                            help="Attempts run at once (sync in threads, async on a loop; "
                                 "default 1).")
        parser.add_argument("--processes", type=lambda text: positive_int(text, MOST_PROCESSES),
                            default=1,
                            help="Worker processes, each with its own --concurrency slots and "
                                 "connections, under one supervisor that restarts a child that "
                                 "dies and passes SIGTERM on (default 1: this process is the "
                                 "worker). Use about one per core.")
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
        if options["processes"] > 1:
            self._supervise(options)
            return
        if options["reload"]:
            reloading.run(functools.partial(self._serve_alone, options))
            return
        self._serve(options)

    def _serve_alone(self, options: dict[str, Any]) -> None:
        self._serve(options)

    def _supervise(self, options: dict[str, Any]) -> None:
        """N children under `runtime.supervisor`; each serves as `_serve` does."""
        processes = options["processes"]
        if options["reload"]:
            raise CommandError("--reload runs one worker process: drop --processes")
        if options["worker_id"] is not None:
            try:  # each child's id is the given one plus a suffix: it must still fit
                check_worker_names([], self._child_id(options["worker_id"], processes))
            except InvalidInputError as exc:
                raise CommandError(f"--worker-id with --processes: {exc}") from exc
        own = Worker.connections()
        if options["verbosity"] > 0:
            self.stdout.write(f"{processes} worker processes, each: concurrency "
                              f"{options['concurrency']}, {own} database connections "
                              f"({processes * own} in all), however many attempts run")
        self._warn_connections(options["concurrency"], own, processes)
        grace = options["grace"] if options["grace"] is not None else float(app_settings.GRACE)
        supervisor = Supervisor(processes, lambda index: self._serve(options, index),
                                grace=float(grace), burst=options["burst"])
        supervisor.run()

    @staticmethod
    def _child_id(given: str, index: int) -> str:
        """Unique per child start, as a lone worker's default id is per process start."""
        return f"{given}.{index}.{uuid.uuid4().hex[:8]}"

    def _warn_connections(self, concurrency: int, own: int, processes: int) -> None:
        sync_agents = any(not spec.is_async for spec in all_agents().values())
        for warning in check_worker_connections(concurrency, own, sync_agents,
                                                server_max_connections(), processes):
            self.stderr.write(str(warning))

    def _serve(self, options: dict[str, Any], child: int | None = None) -> int:
        """Serve as one worker (`child`: its index under a supervisor)."""
        worker_id = options["worker_id"]
        if child is not None and worker_id is not None:
            worker_id = self._child_id(worker_id, child)
        try:
            worker = Worker(options["queues"], options["concurrency"], burst=options["burst"],
                            worker_id=worker_id,
                            poll_interval=options["poll_interval"], grace=options["grace"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if options["metrics_port"] is not None:
            # Children: one port each, from the given one up (0: any free port each).
            port = options["metrics_port"] + (child or 0) if options["metrics_port"] else 0
            try:
                metrics.serve(port, options["metrics_addr"])
            except metrics.MetricsUnavailable as exc:
                raise CommandError(f"--metrics-port: {exc}") from exc
            except OSError as exc:
                raise CommandError(f"--metrics-port: cannot serve on "
                                   f"{options['metrics_addr']}:{port}: {exc}") from exc
        own = worker.connections()
        if child is None and options["verbosity"] > 0:  # (the supervisor says it for all)
            self.stdout.write(f"worker {worker.worker_id}: concurrency {worker.concurrency}, "
                              f"{own} database connections (writers, claim, lease keeper, "
                              f"listener, live-chunk sender while agents stream), however "
                              f"many attempts run")
        if child is None:
            self._warn_connections(worker.concurrency, own, 1)
        stats = worker.run() if not options["reload"] else reloading.serve(worker)
        if options["verbosity"] > 0:
            self.stdout.write(f"{'' if child is None else f'worker process {child}: '}"
                              f"claimed {stats.claimed} runs; settled {stats.settled or {}}")
        if child is not None:
            return 0  # the child leaves with os._exit: stuck agent threads do not hold it
        if worker.stuck_attempts:
            # Agent code stuck in a call cannot be interrupted; its run was recorded as
            # abandoned. Leave without waiting for those threads.
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(0)
        return 0
