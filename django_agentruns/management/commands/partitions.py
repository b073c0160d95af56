from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.ops import partitions


class Command(BaseCommand):
    help = ("Partitioned history (PostgreSQL, AGENTRUNS['HISTORY_PARTITION']): `ensure` creates "
            "the partitions new runs will need, `drop` drops those whose runs are all purged, "
            "`convert` moves plain history tables into the partitioned layout (docs/history.md).")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", nargs="?", default="ensure",
                            choices=("ensure", "drop", "convert", "list"))
        parser.add_argument("--dry-run", action="store_true",
                            help="Say what would be done (convert: how long), change nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        size = partitions.span()
        if size is None:
            raise CommandError("history is not partitioned here: AGENTRUNS['HISTORY_PARTITION'] "
                               "is None, or the database is not PostgreSQL")
        action, dry = options["action"], options["dry_run"]
        if action == "list":
            for part in partitions.partitions():
                self.stdout.write(f"{part.name}: runs {part.lo}..{part.hi - 1}")
            return
        if action == "convert":
            self._convert(size, dry)
            return
        report = partitions.ensure(dry_run=dry) if action == "ensure" else \
            partitions.drop(dry_run=dry)
        if report.busy:
            self.stdout.write("another process holds the lock; nothing done, try again")
        verb = {"ensure": ("would create", "created"), "drop": ("would drop", "dropped")}[action]
        names = report.created if action == "ensure" else report.dropped
        self.stdout.write(f"{verb[0] if dry else verb[1]} {len(names)} partition(s)"
                          + "".join(f"\n  {n}" for n in names))
        for why in report.kept:
            self.stdout.write(f"kept {why}")

    def _convert(self, size: int, dry: bool) -> None:
        estimates = partitions.estimate_conversion()
        if not estimates:
            self.stdout.write("every history table is partitioned already")
            return
        total = sum(e.seconds for e in estimates)
        for e in estimates:
            self.stdout.write(f"{e.table}: {e.rows} rows, {e.bytes / 2**20:.1f} MiB, about "
                              f"{e.seconds:.1f} s locked")
        self.stdout.write(f"about {total:.0f} s in all; each table is locked (reads and writes "
                          "wait) while its rows are copied: stop the workers first")
        if not dry:
            for table in partitions.convert(size):
                self.stdout.write(f"converted {table}")
