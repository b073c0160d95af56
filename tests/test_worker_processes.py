"""Real `runworker` processes: exactly-once execution, mixed sync/async, one log line per step."""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime

import pytest
from django.db.models import Count

from django_agentruns import RunRequest, enqueue_many
from django_agentruns.models import AgentRun, RunEvent, Status
from tests import helpers
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.slow

LOG_LINE = re.compile(
    r"^\S+ \S+ INFO django_agentruns\.worker \[pid (?P<pid>\d+)\] "
    r"run (?P<run>\d+) (?P<agent>\S+) attempt (?P<attempt>\d+) (?P<what>\w+)",
    re.MULTILINE,
)
CLAIMED = re.compile(r"^claimed (\d+) runs; settled \{(.*)\}$", re.MULTILINE)
# The lifecycle event each logged transition stands for.
EVENT_OF = {"started": "run.started", "succeeded": "run.succeeded",
            "requeued": "run.retrying", "dead_lettered": "run.dead_lettered",
            "cancelled": "run.cancelled"}


def log_lines(stderr: str) -> list[tuple[int, int, str]]:
    """(run id, attempt, transition) of each INFO line the worker wrote, in order."""
    return [(int(m["run"]), int(m["attempt"]), m["what"]) for m in LOG_LINE.finditer(stderr)]


def transitions_logged(stderr: str) -> Counter[tuple[int, int, str]]:
    """(run id, attempt, transition) -> how many INFO lines the worker wrote for it."""
    return Counter(log_lines(stderr))


def claimed_count(stdout: str) -> int:
    (match,) = CLAIMED.finditer(stdout)
    return int(match[1])


def test_two_workers_execute_each_of_200_runs_exactly_once(worker_env: dict[str, str]) -> None:
    # Both workers are serving before the runs arrive, so both race for the same rows
    # (on a slow machine one worker could otherwise drain all 200 before the other starts).
    args = ["runworker", "--concurrency", "4"]
    workers = [helpers.start_manage(args, worker_env) for _ in range(2)]
    for w in workers:
        helpers.wait_until(lambda w=w: "serving queues" in w.stderr, timeout=60)
    runs = enqueue_many([RunRequest("tests.once", {"i": i}) for i in range(200)])
    run_ids = {r.pk for r in runs}
    try:
        helpers.wait_until(
            lambda: AgentRun.objects.filter(status=Status.SUCCEEDED).count() == 200, timeout=120)
        codes = [w.stop(timeout=60) for w in workers]
        outputs = [w.output() for w in workers]
        stdouts = [w.stdout for w in workers]
        stderrs = [w.stderr for w in workers]
    finally:
        for w in workers:
            w.close()
    assert codes == [0, 0], "\n".join(outputs)

    statuses = Counter(AgentRun.objects.values_list("status", flat=True))
    assert statuses == {Status.SUCCEEDED: 200}, statuses
    executions = dict(SideEffect.objects.values("run_id").annotate(n=Count("id"))
                      .values_list("run_id", "n"))
    assert set(executions) == run_ids
    assert set(executions.values()) == {1}, {k: v for k, v in executions.items() if v != 1}
    assert set(AgentRun.objects.values_list("attempt", flat=True)) == {1}
    assert not AgentRun.objects.filter(requeue_count__gt=0).exists()

    # Each worker's own account agrees: 200 claims between them, and no run logged twice.
    claims = [claimed_count(out) for out in stdouts]
    assert sum(claims) == 200, claims
    # Both took part, or this would not have tested two workers racing for the same rows.
    assert min(claims) > 0, claims
    started: Counter[int] = Counter()
    for err in stderrs:
        started.update(run for run, _, what in transitions_logged(err) if what == "started")
    assert set(started) == run_ids
    assert set(started.values()) == {1}
    # The output of each run names the run: no result landed on another run's row.
    assert all(r.output == {"run": r.pk} for r in AgentRun.objects.all())


def test_one_worker_runs_sync_and_async_agents_side_by_side(worker_env: dict[str, str]) -> None:
    requests = (
        [RunRequest("tests.async_steps", {"steps": 3, "sleep": 0.05}) for _ in range(8)]
        + [RunRequest("tests.steps", {"steps": 2}) for _ in range(6)]
        + [RunRequest("tests.noop", {"n": i}) for i in range(6)]
        + [RunRequest("tests.once") for _ in range(4)]
    )
    enqueue_many(requests)
    done = helpers.run_manage(["runworker", "--burst", "--concurrency", "4"], worker_env,
                              timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert claimed_count(done.stdout) == len(requests)

    runs = list(AgentRun.objects.all())
    assert {r.status for r in runs} == {Status.SUCCEEDED}, [(r.pk, r.status) for r in runs]
    assert len({r.claimed_by for r in runs}) == 1  # one worker process did all of it
    by_agent: dict[str, list[AgentRun]] = {}
    for r in runs:
        by_agent.setdefault(r.agent, []).append(r)
    assert all(r.output == {"async": True} and r.checkpoint_count == 3
               for r in by_agent["tests.async_steps"])
    assert all(r.output == {"steps": 2} and r.checkpoint_count == 2
               for r in by_agent["tests.steps"])
    assert all(r.output == {"ok": True, "input": r.input} for r in by_agent["tests.noop"])

    step_events = Counter(RunEvent.objects.filter(type="step").values_list("run__agent",
                                                                          flat=True))
    assert step_events == {"tests.async_steps": 8 * 3, "tests.steps": 6 * 2}
    # Async attempts shared the loop at once rather than one after another.
    spans = [(r.started_at, r.finished_at) for r in by_agent["tests.async_steps"]]
    assert max_overlap(spans) > 1, spans


def max_overlap(spans: list[tuple[datetime | None, datetime | None]]) -> int:
    edges: list[tuple[datetime, int]] = []
    for start, end in spans:
        assert start is not None
        assert end is not None
        edges += [(start, 1), (end, -1)]
    live = best = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # ends before starts on ties
        live += step
        best = max(best, live)
    return best


def test_worker_logs_one_info_line_per_transition(worker_env: dict[str, str]) -> None:
    enqueue_many([
        RunRequest("tests.noop"),
        RunRequest("tests.async_steps", {"steps": 1}),
        RunRequest("tests.flaky", {"succeed_on": 2}),  # started, requeued, started, succeeded
        RunRequest("tests.not_retryable"),  # started, dead_lettered
    ])
    done = helpers.run_manage(["runworker", "--burst", "--concurrency", "2"], worker_env,
                              timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

    logged = transitions_logged(done.stderr)
    assert set(logged.values()) == {1}, [k for k, n in logged.items() if n != 1]
    expected = Counter(
        (run_id, attempt, what)
        for run_id, attempt, type_ in RunEvent.objects.values_list("run_id", "attempt", "type")
        for what, event in EVENT_OF.items() if event == type_
    )
    assert logged == expected, done.stderr

    flaky = AgentRun.objects.get(agent="tests.flaky")
    assert [what for (run, _, what) in log_lines(done.stderr) if run == flaky.pk] == [
        "started", "requeued", "started", "succeeded"]
    dead = AgentRun.objects.get(agent="tests.not_retryable")
    assert {what for (run, _, what) in logged if run == dead.pk} == {"started", "dead_lettered"}
    # The dead letter's line says why.
    assert re.search(rf"run {dead.pk} tests\.not_retryable attempt 1 dead_lettered "
                     r"\(not_retryable\): "
                     r"NotRetryable: bad credentials", done.stderr)
