"""Enqueue a few demo runs, work them off with a burst worker, and print what happened."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from django_agentruns import approve, enqueue, set_limit
from django_agentruns.models import AgentRun

TOPICS = ["agent runs", "job queues"]
CITIES = ["Lisbon", "Oslo"]
TEXTS = [
    "Workers claim runs with a lease. A dead worker's lease lapses, and the run is reclaimed. "
    "Retries are bounded, so a poisoned run ends as a dead letter.",
    "Ordered scopes run one at a time, in firing order. Cancelling a run stops it soon.",
]
UNFINISHED = ("queued", "running", "waiting")


def _short(value: Any, width: int = 72) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


class Command(BaseCommand):
    help = "Run the demo agents end to end and print each run with its event timeline."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--timeout",
            type=float,
            default=60.0,
            help="Seconds to keep working before giving up on unfinished runs (default 60).",
        )

    def handle(self, *args: Any, timeout: float, **options: Any) -> None:
        set_limit("demo-llm", 2)  # at most 2 runs of the key at once, on every worker
        # One transaction, like an app enqueueing alongside its own writes: all or nothing.
        with transaction.atomic():
            runs = [
                *(enqueue("demo.research", input={"topic": topic}) for topic in TOPICS),
                *(enqueue("demo.flaky_tool", input={"city": city}) for city in CITIES),
                *(enqueue("demo.async_summarise", input={"text": text}) for text in TEXTS),
                enqueue("demo.refund", input={"order": 1042, "amount": 80}),
                enqueue("demo.llm_chain", input={"steps": 2, "rate_limited": True}),
                enqueue("demo.llm_chain", input={"steps": 2}),
                enqueue("demo.llm_chain", input={"steps": 4}),  # passes its token budget
            ]
        refund = runs[-1].pk
        ids = [run.pk for run in runs]
        self.stdout.write(f"Enqueued {len(ids)} runs: {', '.join(map(str, ids))}\n")

        # A burst worker stops when nothing is due; a run waiting out its retry backoff is
        # not due yet, so keep bursting until every run has settled.
        deadline = time.monotonic() + timeout
        while True:
            call_command("runworker", "--burst", "--concurrency", "4")
            if AgentRun.objects.filter(pk=refund, status="waiting").exists():
                # In the admin, an operator with approve_agentrun would do this on the run's
                # page; the demo plays the operator, lowering the amount.
                self.stdout.write(f"Run {refund} waits for approval of its refund; "
                                  "approving it as demo-operator (amount 80 -> 60).")
                approve(refund, "refund", by="demo-operator", note="partial refund",
                        proposal={"order": 1042, "amount": 60, "reason": "late delivery"})
                continue
            if not AgentRun.objects.filter(pk__in=ids, status__in=UNFINISHED).exists():
                break
            if time.monotonic() > deadline:
                self.stderr.write(f"Some runs are still unfinished after {timeout:g}s.")
                break
            time.sleep(0.2)

        self._print_runs(ids)

    def _print_runs(self, ids: list[int]) -> None:
        for run in AgentRun.objects.filter(pk__in=ids).order_by("pk"):
            style = self.style.SUCCESS if run.status == "succeeded" else self.style.WARNING
            self.stdout.write(
                "\n"
                + style(f"run {run.pk}  {run.agent}  {run.status}")
                + f"  attempts={run.attempt}"
                + (f"  reason={run.reason}" if run.status == "failed" else "")
                + (f"  key={run.limit_key}" if run.limit_key else "")
                + (f"  tokens={run.input_tokens + run.output_tokens} cost={run.cost:g}"
                   if run.input_tokens or run.output_tokens else "")
            )
            self.stdout.write(f"  output: {_short(run.output, 100)}")
            self.stdout.write(f"  {'seq':>4}  {'att':>3}  {'type':<16} payload")
            for event in run.events.order_by("seq"):
                seq, attempt, payload = event.seq, event.attempt, _short(event.payload)
                self.stdout.write(f"  {seq:>4}  {attempt:>3}  {event.type:<16} {payload}")
