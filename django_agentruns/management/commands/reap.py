from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand

from django_agentruns.management.arguments import positive_int
from django_agentruns.runtime.reaper import reap


class Command(BaseCommand):
    help = ("Take back running runs whose lease lapsed (their worker died), and queue again "
            "waiting runs past their wait's deadline. Safe on cron.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Report, change nothing.")
        parser.add_argument("--limit", type=positive_int, default=1000)

    def handle(self, *args: Any, **options: Any) -> None:
        report = reap(limit=options["limit"], dry_run=options["dry_run"])
        if options["dry_run"]:
            self.stdout.write(f"{len(report.stale)} stale runs: {report.stale}")
            return
        self.stdout.write(
            f"stale {len(report.stale)}: requeued {len(report.requeued)}, dead-lettered "
            f"{len(report.dead_lettered)}, cancelled {len(report.cancelled)}, skipped "
            f"{len(report.skipped)} (renewed or settled meanwhile)")
        if report.wait_timeouts or report.parents_resumed:
            self.stdout.write(
                f"waits timed out {len(report.wait_timeouts)}, parents resumed "
                f"{len(report.parents_resumed)}")
        if report.groups_dropped:
            self.stdout.write(f"idle fairness groups deleted {report.groups_dropped}")
