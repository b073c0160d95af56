"""Enqueue a few demo runs, work them off with burst workers, play the operator who approves
the refund and the Pydantic AI assistant's tool call, and print what happened: one line per
run, the assistant's answer, then what to try next.

The assistant talks to the demo's canned model server (example_project/demo/model_server.py,
started in this process), or to a real provider when OPENAI_API_KEY / OPENAI_BASE_URL is set."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Min
from django.utils import timezone

from django_agentruns import approve, enqueue, set_limit
from django_agentruns.models import AgentRun, RunWait, Status
from django_agentruns.registry import find_agent
from django_agentruns.runtime.worker import Worker

from ...views import ASSISTANT, ASSISTANT_INPUT

TOPICS = ["agent runs", "job queues"]
CITIES = ["Lisbon", "Oslo"]
TEXTS = [
    "Workers claim runs with a lease. A dead worker's lease lapses, and the run is reclaimed. "
    "Retries are bounded, so a poisoned run ends as a dead letter.",
    "Ordered scopes run one at a time, in firing order. Cancelling a run stops it soon.",
]
UNFINISHED = (Status.QUEUED, Status.RUNNING, Status.WAITING)
REFUND_AGENT, REFUND_KEY = "demo.refund", "refund"
LONGEST_NAP = 1.0  # seconds between bursts while the next run is not due yet


def _short(value: Any, width: int = 72) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _python() -> str:
    """How the user runs Python here: the venv's interpreter relative to the checkout."""
    path = os.path.relpath(sys.executable)
    return "python" if path.startswith("..") else path


class Command(BaseCommand):
    help = ("Run the demo agents end to end, approve the refund run as an operator would, "
            "and print each run; exits non-zero if a run is left unfinished.")

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
                enqueue(REFUND_AGENT, input={"order": 1042, "amount": 80}),
                enqueue("demo.llm_chain", input={"steps": 2, "rate_limited": True}),
                enqueue("demo.llm_chain", input={"steps": 2}),
                enqueue("demo.llm_chain", input={"steps": 4}),  # passes its token budget
            ]
            if find_agent(ASSISTANT) is not None:  # the Pydantic AI agent, where installed
                runs.append(enqueue(ASSISTANT, input=ASSISTANT_INPUT))
        ids = [run.pk for run in runs]
        self.stdout.write(f"Enqueued {len(ids)} runs: {', '.join(map(str, ids))}")
        verbose = options["verbosity"] > 1
        # The worker's own log (a line per attempt) only when asked for: the table below
        # says what happened to each run.
        worker_log = logging.getLogger("django_agentruns")
        level = worker_log.level
        if not verbose:
            worker_log.setLevel(logging.WARNING)
        try:
            self._work(ids, timeout)
        finally:
            worker_log.setLevel(level)
        self._print_runs(ids, verbose)
        self._print_assistant(ids)
        left = AgentRun.objects.filter(pk__in=ids, status__in=UNFINISHED).count()
        if left:
            raise CommandError(f"{left} run{'' if left == 1 else 's'} left unfinished "
                               f"after {timeout:g}s: see the lines above, or "
                               f"manage.py why <id>")
        self._next_steps()

    def _work(self, ids: list[int], timeout: float) -> None:
        """Burst until every run is finished, or only waiting runs are left (nobody else
        will answer them), or the time is up."""
        runs = AgentRun.objects.filter(pk__in=ids)
        refund = runs.filter(agent=REFUND_AGENT).values_list("pk", flat=True).get()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = Worker(["default"], 4, burst=True).run(install_signals=False)
            if stats.claimed:
                self.stdout.write(f"worker burst: claimed {stats.claimed} "
                                  f"run{'' if stats.claimed == 1 else 's'}; "
                                  f"settled {dict(sorted(stats.settled.items()))}")
            if runs.filter(pk=refund, status=Status.WAITING, wait_key=REFUND_KEY).exists():
                # In the admin, an operator with approve_agentrun does this on the run's
                # page; the demo plays the operator, lowering the amount.
                self.stdout.write(f"Run {refund} waits for approval of its refund; "
                                  "approving it as demo-operator (amount 80 -> 60).")
                approve(refund, REFUND_KEY, by="demo-operator", note="partial refund",
                        proposal={"order": 1042, "amount": 60, "reason": "late delivery"})
                continue
            if self._approve_tool_calls(runs):
                continue
            unfinished = runs.filter(status__in=UNFINISHED)
            if not unfinished.exclude(status=Status.WAITING).exists():
                return  # all finished, or only waits nobody here will answer
            # A run in its retry backoff (or snoozed) is not due yet: nap until it is.
            due = unfinished.filter(status=Status.QUEUED).aggregate(at=Min("available_at"))
            ahead = (due["at"] - timezone.now()).total_seconds() if due["at"] else 0.05
            time.sleep(min(LONGEST_NAP, max(0.05, ahead), max(0.0, deadline - time.monotonic())))

    def _approve_tool_calls(self, runs: Any) -> bool:
        """Approve the Pydantic AI assistant's tool calls waiting for a person (on the run's
        admin page, an operator's Approve): whether there was one."""
        waits = RunWait.objects.filter(
            run__in=runs.filter(agent=ASSISTANT, status=Status.WAITING),
            kind=RunWait.Kind.APPROVAL, delivered_at__isnull=True).select_related("run")
        answered = False
        for wait in waits:
            if wait.run.wait_key != wait.key:
                continue
            prompt = wait.prompt if isinstance(wait.prompt, dict) else {}
            call = prompt.get("proposal") if isinstance(prompt.get("proposal"), dict) else {}
            self.stdout.write(f"Run {wait.run_id} ({ASSISTANT}, Pydantic AI) asks to call "
                              f"{call.get('tool')}({_short(call.get('args'), 40)}); "
                              "approving it as demo-operator.")
            approve(wait.run_id, wait.key, by="demo-operator", note="within policy")
            answered = True
        return answered

    def _print_runs(self, ids: list[int], verbose: bool) -> None:
        self.stdout.write("")
        for run in AgentRun.objects.filter(pk__in=ids).order_by("pk"):
            style = self.style.SUCCESS if run.status == Status.SUCCEEDED else self.style.WARNING
            self.stdout.write(
                style(f"run {run.pk:>3}  {run.agent:<20} {run.status}")
                + f"  attempts={run.attempt}"
                + (f"  reason={run.reason}" if run.status == Status.FAILED else "")
                + (f"  tokens={run.input_tokens + run.output_tokens} cost={run.cost:g}"
                   if run.input_tokens or run.output_tokens else "")
                + f"  output: {_short(run.output, 60)}")
            if verbose:
                for event in run.events.order_by("seq"):
                    self.stdout.write(f"      {event.seq:>4}  {event.attempt:>3}  "
                                      f"{event.type:<16} {_short(event.payload)}")

    def _print_assistant(self, ids: list[int]) -> None:
        """The Pydantic AI assistant's streamed answer, whole, and which model wrote it."""
        run = AgentRun.objects.filter(pk__in=ids, agent=ASSISTANT).first()
        if run is None or not isinstance(run.output, dict):
            return
        self.stdout.write(f"\nRun {run.pk} ({ASSISTANT}, model {run.output['model']}) answered: "
                          f"{_short(run.output['answer'], 200)}")

    def _next_steps(self) -> None:
        python = _python()
        self.stdout.write(self.style.SUCCESS("\nEvery run finished.") + " Next steps:")
        self.stdout.write(f"  {python} manage.py createsuperuser   # an admin login")
        self.stdout.write(f"  {python} manage.py runserver")
        self.stdout.write("  then open http://127.0.0.1:8000/admin/django_agentruns/agentrun/"
                          " (the runs, each with its timeline; Overview at the top right)")
        self.stdout.write("  and http://127.0.0.1:8000/demo/live/ (the Pydantic AI assistant "
                          "streams its answer and waits for your approval in the admin; "
                          "with a worker running: manage.py runworker)")
        self.stdout.write("  A real model for the assistant: OPENAI_API_KEY=... (or "
                          "OPENAI_BASE_URL=...) and DEMO_MODEL=gpt-4o-mini")
        self.stdout.write("  Each run's timeline and the worker's log: manage.py demo "
                          "--verbosity 2")
