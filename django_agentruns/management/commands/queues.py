from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db.models import Count

from django_agentruns.exceptions import InvalidInputError
from django_agentruns.management.arguments import os_user
from django_agentruns.models import AgentRun, Status
from django_agentruns.queues import pause_queue, paused_queues, resume_queue
from django_agentruns.registry import all_agents


class Command(BaseCommand):
    help = "List queues (paused or not, with their backlog), or pause or resume one."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", nargs="?", default="list",
                            choices=("list", "pause", "resume"))
        parser.add_argument("name", nargs="?", help="The queue (pause and resume).")
        parser.add_argument("--by", default=os_user(),
                            help="Who pauses or resumes (recorded; default: the OS user).")

    def handle(self, *args: Any, **options: Any) -> None:
        action, name = options["action"], options["name"]
        if action == "list":
            if name:
                raise CommandError("list takes no queue name")
            self._list()
            return
        if not name:
            raise CommandError(f"{action} needs a queue name")
        try:
            if action == "pause":
                done = pause_queue(name, by=options["by"])
                self.stdout.write(f"queue {name!r} " + ("paused" if done else "was paused already"))
            else:
                done = resume_queue(name, by=options["by"])
                self.stdout.write(f"queue {name!r} " + ("resumed" if done else "was not paused"))
        except InvalidInputError as exc:
            raise CommandError(str(exc)) from None

    def _list(self) -> None:
        paused = paused_queues()
        counts = {(row["queue"], row["status"]): row["n"] for row in
                  AgentRun.objects.unfinished().values("queue", "status")
                  .annotate(n=Count("id")).order_by()}
        names = sorted({q for q, _ in counts} | set(paused)
                       | {s.effective_queue() for s in all_agents().values()})
        for name in names:
            pause = paused.get(name)
            state = "active" if pause is None else (
                f"PAUSED since {pause.paused_at:%Y-%m-%d %H:%M:%S %Z}"
                + (f" by {pause.paused_by}" if pause.paused_by else ""))
            self.stdout.write(f"{name}: {state}; queued {counts.get((name, Status.QUEUED), 0)}, "
                              f"running {counts.get((name, Status.RUNNING), 0)}")
