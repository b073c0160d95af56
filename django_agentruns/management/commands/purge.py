from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.exceptions import InvalidInputError
from django_agentruns.management.arguments import positive_int
from django_agentruns.models import TERMINAL
from django_agentruns.ops.retention import PurgeReport, parse_duration, purge


def duration(text: str) -> Any:
    try:
        return parse_duration(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def status_list(text: str) -> list[str]:
    statuses = [s.strip() for s in text.split(",") if s.strip()]
    unknown = set(statuses) - set(TERMINAL)
    if not statuses or unknown:
        raise argparse.ArgumentTypeError(
            f"choose from {', '.join(TERMINAL)}, comma-separated; not {text!r}")
    return statuses


class Command(BaseCommand):
    help = "Delete finished runs (and their events) older than a duration. Dead letters stay."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--older-than", type=duration, required=True,
                            help="e.g. 30d, 12h, 2w: runs that finished longer ago than this")
        parser.add_argument("--status", type=status_list, default=None,
                            help=f"Comma-separated subset of {', '.join(TERMINAL)} (default all).")
        parser.add_argument("--include-dead-letters", action="store_true",
                            help="Also delete dead letters (kept by default).")
        parser.add_argument("--batch-size", type=positive_int, default=1000)
        parser.add_argument("--dry-run", action="store_true", help="Count, delete nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        def progress(report: PurgeReport) -> None:
            if options["verbosity"] > 1:
                self.stdout.write(f"  batch {report.batches}: {report.runs} runs so far")

        try:
            report = purge(options["older_than"], statuses=options["status"],
                           include_dead_letters=options["include_dead_letters"],
                           batch_size=options["batch_size"], dry_run=options["dry_run"],
                           progress=progress)
        except InvalidInputError as exc:
            raise CommandError(str(exc)) from exc
        verb = "would delete" if options["dry_run"] else "deleted"
        self.stdout.write(f"{verb} {report.runs} runs and {report.events} events")
        if report.partitions:
            verb = "would drop" if options["dry_run"] else "dropped"
            self.stdout.write(f"{verb} {len(report.partitions)} history partition(s): "
                              f"{', '.join(report.partitions)}")
