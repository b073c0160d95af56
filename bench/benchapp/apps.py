from __future__ import annotations

import os

from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "bench.benchapp"
    label = "bench"
    verbose_name = "Benchmark agents and tasks"

    def ready(self) -> None:
        # Django's task framework has no autodiscovery: import the tasks so the worker
        # and the clients resolve them by path alike.
        from . import djtasks  # noqa: F401

        if os.environ.get("BENCH_STATEMENTS_FILE"):
            from .probe import count_statements

            count_statements(os.environ["BENCH_STATEMENTS_FILE"])
