from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_agentruns.management.arguments import run_id
from django_agentruns.models import AgentRun, Status
from django_agentruns.ops.diagnosis import advice, short_error
from django_agentruns.ops.visibility import why_not_started
from django_agentruns.ops.waits import explain_wait
from django_agentruns.ops.workers import Coverage


class Command(BaseCommand):
    help = "Say why a run is not starting (read-only: writes nothing)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("run_id", type=run_id, help="The run's id.")

    def handle(self, *args: Any, **options: Any) -> None:
        run = AgentRun.objects.for_reading().filter(pk=options["run_id"]).first()
        if run is None:
            raise CommandError(f"No run with id {options['run_id']}")
        waiting = explain_wait(run)
        if waiting is not None:
            self.stdout.write(waiting.headline)
            for line in waiting.lines:
                self.stdout.write(f"- {line}")
            return
        holds = why_not_started(run)
        if run.status != Status.QUEUED:
            # Not a question of starting: say what it is, and what to do about it.
            state = str(holds[0]).removeprefix(f"run #{run.pk} ") if holds else run.status
            self.stdout.write(f"run #{run.pk} ({run.agent}) {state}")
            if run.error_type and run.status == Status.FAILED:
                self.stdout.write(f"- last error: {run.error_type}: "
                                  f"{short_error(run.error_message, 300)}")
            if advice(run):
                self.stdout.write(f"- {advice(run)}")
            return
        gap = Coverage.read().gap(run)
        if not holds:
            if gap:
                self.stdout.write(f"run #{run.pk} ({run.agent}) is due, but {gap}")
                return
            self.stdout.write(f"run #{run.pk} ({run.agent}) is due now: nothing holds it back; "
                              f"a worker serving queue {run.queue!r} will claim it")
            return
        self.stdout.write(f"run #{run.pk} ({run.agent}) is not starting:")
        for hold in [*holds, *([gap] if gap else [])]:
            self.stdout.write(f"- {hold}")
