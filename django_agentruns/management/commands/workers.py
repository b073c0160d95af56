from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand
from django.utils import timezone

from django_agentruns.models import WorkerRecord
from django_agentruns.ops import workers


class Command(BaseCommand):
    help = ("List the live workers: id, queues, concurrency, agents, version, started, "
            "last seen (read-only).")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--all", action="store_true",
                            help="Also list workers no longer beating (died or lost the "
                                 "database within the last day).")

    def handle(self, *args: Any, **options: Any) -> None:
        at = timezone.now()
        records = WorkerRecord.objects.all() if options["all"] else workers.live(at)
        shown = 0
        for record in records.order_by("worker_id"):
            shown += 1
            alive = workers.is_live(record, at)
            seen = (at - record.last_seen_at).total_seconds()
            self.stdout.write(
                f"{record.worker_id}  {'live' if alive else 'GONE'}  "
                f"queues={','.join(record.queues)}  concurrency={record.concurrency}  "
                f"agents={len(record.agents)}  version={record.version}  "
                f"started={record.started_at.isoformat(timespec='seconds')}  "
                f"last_seen={seen:.1f}s ago")
        if not shown:
            self.stdout.write("no live workers" if not options["all"] else "no workers recorded")
