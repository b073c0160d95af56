from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_agentruns.ops.agent_versions import unfinished_versions


class Command(BaseCommand):
    help = ("List, per agent, the versions its unfinished runs started under and whether "
            "the code registered here can resume them (read-only).")

    def handle(self, *args: Any, **options: Any) -> None:
        rows = unfinished_versions()
        if not rows:
            self.stdout.write("No unfinished runs.")
        for row in rows:
            self.stdout.write(f"{row.agent} v{row.version}: {row.runs} unfinished run"
                              f"{'' if row.runs == 1 else 's'}, {row.explained}")
