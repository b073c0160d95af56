"""The chaos suite's deliverer: sends each waiting chaos run its payload, at a random time.

Runs as a process of its own until killed. Each run of `tests.chaos_waits` gets
``{"run": id}`` for its key at a random time: a quarter of them before they start (the run
finds it without waiting), the rest 0-2 s after an attempt started (before its wait, during
it, or after a kill took the attempt away). Some get it twice (a retrying webhook). A database
that goes away (a restart) is waited out.
"""

from __future__ import annotations

import random
import time
from typing import Any

from django.core.management.base import BaseCommand
from django.db import DatabaseError, InterfaceError, connections
from django.utils import timezone

from django_agentruns import deliver
from django_agentruns.models import TERMINAL, AgentRun, RunWait
from tests.testapp.chaos_agents import CHAOS_WAITS, WAIT_KEY


class Command(BaseCommand):
    help = "Deliver the chaos suite's payloads until killed."

    def handle(self, *args: Any, **options: Any) -> None:
        delivered: set[int] = set()
        while True:
            try:
                self.round(delivered)
            except (DatabaseError, InterfaceError):
                connections.close_all()
                time.sleep(0.2)
            time.sleep(0.05)

    def round(self, delivered: set[int]) -> None:
        now = timezone.now()
        done = set(RunWait.objects.filter(key=WAIT_KEY, delivered_at__isnull=False)
                   .values_list("run_id", flat=True))
        rows = AgentRun.objects.filter(agent=CHAOS_WAITS).exclude(status__in=TERMINAL) \
            .values_list("pk", "created_at", "started_at")
        for pk, created, started in rows:
            if pk in done:
                continue
            chance = random.Random(pk)
            early = chance.random() < 0.25
            since = created if early else started
            if since is None or (now - since).total_seconds() < chance.uniform(0, 2):
                continue
            result = deliver(pk, WAIT_KEY, {"run": pk}, by="chaos-deliverer")
            self.stdout.write(f"run {pk}: {result.value}")
            delivered.add(pk)
            if random.Random(-pk).random() < 0.2:  # a webhook that retries
                deliver(pk, WAIT_KEY, {"run": pk, "again": True}, by="chaos-deliverer")
