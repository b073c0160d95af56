from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.management.arguments import run_id
from django_agentruns.models import AgentRun
from django_agentruns.visibility import why_not_started


class Command(BaseCommand):
    help = "Say why a run is not starting (read-only: writes nothing)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_id", type=run_id, help="The run's id.")

    def handle(self, *args: Any, **options: Any) -> None:
        run = AgentRun.objects.filter(pk=options["run_id"]).first()
        if run is None:
            raise CommandError(f"No run with id {options['run_id']}")
        holds = why_not_started(run)
        if not holds:
            self.stdout.write(f"run #{run.pk} ({run.agent}) is due now: nothing holds it back; "
                              f"a worker serving queue {run.queue!r} will claim it")
            return
        self.stdout.write(f"run #{run.pk} ({run.agent}) is not starting:")
        for hold in holds:
            self.stdout.write(f"- {hold}")
