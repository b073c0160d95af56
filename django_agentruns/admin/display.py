"""How the admin shows a run: badges, durations, JSON, errors, leases. Pure rendering.

Every function takes values already loaded on the row, so the run list renders 100 rows
with no extra query.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db.models import TextField
from django.db.models.functions import Cast, Substr
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..models import AgentRun, RunCheckpoint, RunStep, Status
from ..ops.workers import lapse

BADGE_COLOURS: dict[str, str] = {
    Status.QUEUED: "#5b6b7a",
    Status.RUNNING: "#1f6fb2",
    Status.WAITING: "#6a4fb3",
    Status.SUCCEEDED: "#2e7d32",
    Status.FAILED: "#c62828",
    Status.CANCELLED: "#8a6d3b",
}
STUCK_COLOUR = "#b35900"  # white text on it passes WCAG AA, as on every badge colour here


def short_duration(seconds: float) -> str:
    """850 ms, 12 s, 3 min 4 s, 2 h 5 min, 3 d 4 h: two units at most."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{round(seconds * 1000)} ms"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{int(seconds)} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def _since(start: datetime, end: datetime | None = None) -> float:
    return ((end or timezone.now()) - start).total_seconds()


def timestamp(value: datetime | None) -> str:
    """Compact and sortable, in the current time zone: 2026-11-29 23:16:40."""
    return "" if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S")


def status_badge(run: AgentRun, live_workers: set[str] | None = None) -> SafeString:
    """The status in a coloured badge. Given the live workers' ids, a running run whose
    lease lapsed says it is stuck, and whether its worker is gone, rather than "Running"."""
    stuck = None if live_workers is None else lapse(run, live_workers)
    if stuck is not None:
        return format_html('<span class="agentruns-badge agentruns-stuck" style="background:{}">'
                           'Stuck: {}</span>', STUCK_COLOUR, stuck)
    colour = BADGE_COLOURS.get(run.status, "#5b6b7a")
    label = run.get_status_display()
    if run.status == Status.RUNNING and run.cancel_requested_at is not None:
        label = f"{label} (cancelling)"
    elif run.is_dead_letter:
        label = f"{label} (dead letter)"
    return format_html('<span class="agentruns-badge" style="background:{}">{}</span>',
                       colour, label)


def duration_or_age(run: AgentRun) -> str:
    """Finished: enqueue to settlement. Running: this attempt so far. Queued: time waited
    since it became due (or the time left until it does)."""
    if run.finished_at is not None:
        return f"took {short_duration(_since(run.created_at, run.finished_at))}"
    if run.status == Status.RUNNING and run.started_at is not None:
        return f"running {short_duration(_since(run.started_at))}"
    if run.status == Status.WAITING:  # for what, not since when: the run page has the time
        return "waiting for child runs" if run.wait_key.startswith("~") \
            else f"waiting for {run.wait_key!r}"
    if run.available_at > timezone.now():
        return f"due in {short_duration(-_since(run.available_at))}"
    return f"waiting {short_duration(_since(run.available_at))}"


def reason(run: AgentRun) -> SafeString:
    """The reason, and for a failure its error class (short name; the full path on hover)."""
    if run.status == Status.FAILED and run.error_type:
        return format_html('{} <span class="agentruns-muted" title="{}">{}</span>',
                           run.get_reason_display(), run.error_type,
                           run.error_type.rsplit(".", 1)[-1])
    return format_html("{}", run.get_reason_display() if run.reason else "")


def pretty_json(value: Any) -> SafeString:
    if value is None:
        return format_html('<span class="agentruns-muted">{}</span>', "none")
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)
    return format_html('<pre class="agentruns-json">{}</pre>', text)


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def last_error(run: AgentRun) -> SafeString:
    if not run.error_type and not run.error_message:
        return format_html('<span class="agentruns-muted">{}</span>', "none")
    traceback = run.error_traceback or "(no traceback recorded)"
    return format_html('<strong>{}</strong>: {}<pre class="agentruns-traceback">{}</pre>',
                       run.error_type, run.error_message, traceback)


def lease(run: AgentRun) -> str:
    """Who holds the run and for how long: the answer to "is its worker still alive?"."""
    if run.status != Status.RUNNING:
        return "none (not running)"
    if run.lease_expires is None:
        return f"held by {run.claimed_by} with no lease (an interactive run)"
    left = -_since(run.lease_expires)
    if left >= 0:
        return f"held by {run.claimed_by}; {short_duration(left)} left"
    return (f"held by {run.claimed_by}; lapsed {short_duration(-left)} ago "
            f"(stuck: see the top of the page for who, if anyone, takes it back)")


def requeues(run: AgentRun) -> str:
    return f"{run.requeue_count} of {run.max_requeues}"


def cancel_request(run: AgentRun) -> str:
    if run.cancel_requested_at is None:
        return "none"
    why = f": {run.cancel_reason}" if run.cancel_reason else ""
    return f"at {timestamp(run.cancel_requested_at)}{why}"


def explanation(holds: Any, link: Callable[[int], str]) -> SafeString:
    """`visibility.why_not_started`'s answer, one line per hold, linking any blocking run."""
    if not holds:
        return format_html('<span class="agentruns-muted">{}</span>',
                           "nothing holds it back: it starts when a worker is free")
    if isinstance(holds, str):
        holds = [holds]
    lines = []
    for hold in holds:
        blocker = getattr(hold, "blocker", None)
        lines.append(format_html("{}", hold) if blocker is None else format_html(
            '{} (<a href="{}">#{}</a>)', hold, link(blocker), blocker))
    return format_html("<ul>{}</ul>", format_html_join("", "<li>{}</li>",
                                                       ((line,) for line in lines)))


CHECKPOINTS_SHOWN = 50
STATE_PREVIEW = 200


def checkpoints(run: AgentRun) -> dict[str, Any]:
    """The run's latest checkpoints, each with the start of its state: at most
    CHECKPOINTS_SHOWN rows and STATE_PREVIEW characters each, cut in the database, so a
    run with thousands of large states costs the page no more than a few."""
    rows = list(RunCheckpoint.objects.filter(run=run).order_by("-number").annotate(
        preview=Substr(Cast("state", TextField()), 1, STATE_PREVIEW + 1))
        .values("number", "created_at", "preview")[:CHECKPOINTS_SHOWN])
    for row in rows:
        text = row["preview"] or "null"
        row["preview"] = text if len(text) <= STATE_PREVIEW else text[:STATE_PREVIEW] + "…"
    return {"rows": rows, "total": run.checkpoint_count, "shown": len(rows)}


def run_link(run_id: int | None, url: Callable[[int], str]) -> SafeString:
    if run_id is None:
        return format_html("{}", "—")
    return format_html('<a href="{}">#{}</a>', url(run_id), run_id)


STEPS_SHOWN = 200


def steps(run: AgentRun) -> dict[str, Any]:
    """The run's durable steps, compact (name, duration, attempt, usage, a failed one's
    error), at most STEPS_SHOWN; and for a fork, its origin's beside them, by step."""
    rows = [_step_row(step) for step in RunStep.objects.filter(run=run).order_by("id")
            .defer("result")[:STEPS_SHOWN]]
    origin = None
    if run.forked_from_id is not None:
        theirs = {(s.name, s.occurrence): s for s in
                  RunStep.objects.filter(run_id=run.forked_from_id)[:STEPS_SHOWN]}
        mine = {(s.name, s.occurrence): s for s in RunStep.objects.filter(run=run)[:STEPS_SHOWN]}
        keys = list(dict.fromkeys([*theirs, *mine]))
        origin = {
            "run": run.forked_from,
            "rows": [{"step": f"{name}/{n}",
                      "origin": _result_preview(theirs.get((name, n))),
                      "fork": _result_preview(mine.get((name, n))),
                      "replayed": (name, n) in mine and mine[(name, n)].replayed_from
                      is not None,
                      "differs": _result_preview(theirs.get((name, n)))
                      != _result_preview(mine.get((name, n)))} for name, n in keys],
        }
    return {"rows": rows, "total": RunStep.objects.filter(run=run).count() if rows else 0,
            "origin": origin}


def _step_row(step: RunStep) -> dict[str, Any]:
    took = None if step.finished_at is None else \
        short_duration((step.finished_at - step.started_at).total_seconds())
    return {"name": step.name, "occurrence": step.occurrence, "status": step.status,
            "attempt": step.attempt, "duration": took or "—",
            "tokens": step.input_tokens + step.output_tokens, "cost": step.cost,
            "error": step.error, "replayed": step.replayed_from is not None}


def _result_preview(step: RunStep | None) -> str:
    if step is None:
        return "—"
    if step.status != RunStep.State.DONE:
        return str(step.status)
    text = compact_json(step.result)
    return text if len(text) <= STATE_PREVIEW else text[:STATE_PREVIEW] + "…"


def compared_outputs(run: AgentRun) -> dict[str, str] | None:
    """A fork's output beside its origin's, each cut to a preview."""
    origin = run.forked_from
    if origin is None:
        return None

    def cut(value: Any) -> str:
        text = compact_json(value)
        return text if len(text) <= STATE_PREVIEW * 2 else text[:STATE_PREVIEW * 2] + "…"

    return {"origin": cut(origin.output), "fork": cut(run.output)}
