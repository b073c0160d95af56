from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.exceptions import InvalidInputError, RunNotFoundError
from django_agentruns.management.arguments import run_id
from django_agentruns.ops.retention import erase


class Command(BaseCommand):
    help = ("Delete one finished (or cancelled) run and everything it stored, now: events, "
            "checkpoints, waits and deliveries, usage, live output.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_id", type=run_id, help="The run's id.")
        parser.add_argument("--by", default="", help="Who asked (recorded in the log).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            report = erase(options["run_id"], by=options["by"])
        except (InvalidInputError, RunNotFoundError) as exc:
            raise CommandError(str(exc)) from exc
        stored = ", ".join(f"{count} {name}" for name, count in report.rows.items() if count)
        self.stdout.write(f"erased run {report.run_id} ({stored})")
