from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from django_agentruns.models import Schedule
from django_agentruns.registry import all_agents
from django_agentruns.schedules import next_tick, sync_declared


class Command(BaseCommand):
    help = "List the schedules with their next tick."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--no-sync", action="store_true",
                            help="Do not write the rows of schedules declared on agents first.")

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["no_sync"]:
            sync_declared(all_agents().values())  # a new @agent(schedule=) shows at once
        at = timezone.now()
        rows = list(Schedule.objects.all())
        if not rows:
            self.stdout.write("no schedules")
            return
        for row in rows:
            when = f"cron {row.cron!r}" + (f" ({row.tz})" if row.tz else "") if row.cron \
                else f"every {row.every}s"
            try:
                upcoming = "paused" if not row.enabled else \
                    f"next tick {next_tick(row, at).isoformat()}"
            except Exception as exc:  # a row edited into nonsense: say so, list the rest
                upcoming = f"cannot tick: {exc}"
            last = row.last_tick.isoformat() if row.last_tick else "never"
            self.stdout.write(f"{row.name}: {row.agent}, {when}"
                              f"{', catch-up' if row.catch_up else ''}; {upcoming}; "
                              f"last tick {last} [{row.origin}]")
