"""Tables written beside a run's events: its durable steps (`RunStep`), its live chunks on
SQLite (`StreamChunk`), the values kept out of its row (`RunPayload`), and LangGraph's
checkpoint saver's tables
(`integrations.langgraph.AgentRunsSaver`). Registered with the app by `models`, which
re-exports them; they name the run table by its label, so this module imports nothing
of the package.

A graph's checkpoints belong to its thread (`thread_id`), not to a run: a thread goes on
across runs (a conversation), as with LangGraph's own savers, until the application
deletes it (`AgentRunsSaver().delete_thread(thread_id)`). `run` says which run wrote a
checkpoint (None outside one, or once that run is purged). Values are stored as the
saver's serializer made them (a type tag and bytes).
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class StreamChunk(models.Model):
    """SQLite only: a live chunk (`ctx.stream`) on its way to the web processes' poller.

    PostgreSQL sends chunks by NOTIFY and stores none. Here they wait in this small table
    until the attempt coalesces them into one `stream` event, which prunes them.
    """

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey("django_agentruns.AgentRun", on_delete=models.CASCADE,
                            related_name="+", db_index=False)  # agentruns_chunk_run
    attempt = models.PositiveIntegerField()
    channel = models.CharField(max_length=100)
    first = models.PositiveIntegerField(help_text=_("Index of its first chunk in the attempt."))
    end = models.PositiveIntegerField(help_text=_("Index past its last chunk."))
    text = models.TextField()

    class Meta:
        verbose_name = _("stream chunk")
        verbose_name_plural = _("stream chunks")
        indexes = (models.Index(fields=("run", "id"), name="agentruns_chunk_run"),)

    def __str__(self) -> str:
        return f"#{self.run_id} {self.channel}[{self.first}:{self.end}]"


class RunPayload(models.Model):
    """A run's bulky values kept out of its row (issue #29's narrow hot row), append-only:
    the latest row of a kind is the value. Its input (`INPUT`, written with the run; a
    debounce appends the newer one; the default {} is no row), its output (`OUTPUT`,
    written by the statement that records the success; None is no row), and the last
    error's traceback (`TRACEBACK`, written by `transitions.settling` in the transaction
    that records the error); read through by `AgentRun.input`, `.output` and
    `.error_traceback`. Partitioned with the history."""

    INPUT = "input"
    OUTPUT = "output"
    TRACEBACK = "traceback"

    id = models.BigAutoField(primary_key=True)
    # No index of its own: `agentruns_payload_kind` leads with the run. No database
    # foreign key (migration 0026): purge and erase delete a run's payloads themselves,
    # and the check cost every input an enqueue writes.
    run = models.ForeignKey("django_agentruns.AgentRun", on_delete=models.CASCADE,
                            related_name="+", db_index=False, db_constraint=False)
    kind = models.CharField(max_length=20)
    value = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = _("run payload")
        verbose_name_plural = _("run payloads")
        indexes = (models.Index(fields=("run", "kind", "id"), name="agentruns_payload_kind"),)

    def __str__(self) -> str:
        return f"#{self.run_id} {self.kind}"


class RunStep(models.Model):
    """One durable step of a run (`ctx.step`): its result once done, so no later attempt
    of the run executes it again. Written by `transitions.steps` only, fenced."""

    class State(models.TextChoices):
        STARTED = "started", "Started"
        """Its execution began; if the attempt died, the next one executes it again."""
        DONE = "done", "Done"
        """Its result is stored: every later attempt gets it without executing the step."""
        FAILED = "failed", "Failed"
        """Its last execution raised (or timed out); a later attempt executes it again."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey("django_agentruns.AgentRun", on_delete=models.CASCADE,
                            related_name="steps", db_index=False)  # agentruns_step_occurrence
    name = models.CharField(max_length=200)
    occurrence = models.PositiveIntegerField(help_text=_("1, 2, 3... per name, in call order."))
    status = models.CharField(max_length=16, choices=State.choices, default=State.STARTED)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    attempt = models.PositiveIntegerField(default=0, help_text=_("The attempt that last ran it."))
    checkpoint = models.PositiveIntegerField(
        default=0, help_text=_("The run's checkpoint count when the step first started."))
    replayed_from = models.BigIntegerField(
        null=True, blank=True, help_text=_("Copied from this run's step by a replaying fork."))
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cost = models.FloatField(default=0.0)

    class Meta:
        verbose_name = _("run step")
        verbose_name_plural = _("run steps")
        ordering = ("run", "id")
        constraints = (
            models.UniqueConstraint(fields=("run", "name", "occurrence"),
                                    name="agentruns_step_occurrence"),
        )

    def __str__(self) -> str:
        return f"#{self.run_id} {self.name}/{self.occurrence} ({self.status})"

    @property
    def key(self) -> str:
        """The step's idempotency key (`ctx.step_key`)."""
        return step_key(self.run_id, self.name, self.occurrence)


def step_key(run_id: int, name: str, occurrence: int) -> str:
    return f"run-{run_id}/{name}/{occurrence}"


class GraphCheckpoint(models.Model):
    """One checkpoint of a graph's thread (in a namespace: "" for the graph, a subgraph's
    otherwise). Written through the run's fence when a run writes it."""

    id = models.BigAutoField(primary_key=True)
    thread_id = models.CharField(max_length=255)
    checkpoint_ns = models.CharField(max_length=255, blank=True, default="")
    checkpoint_id = models.CharField(max_length=64)
    parent_checkpoint_id = models.CharField(max_length=64, blank=True, default="")
    run = models.ForeignKey("django_agentruns.AgentRun", null=True, blank=True,
                            on_delete=models.SET_NULL, related_name="+", db_constraint=False)
    type = models.CharField(max_length=32)
    checkpoint = models.BinaryField()
    metadata_type = models.CharField(max_length=32)
    metadata = models.BinaryField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ("thread_id", "checkpoint_ns", "checkpoint_id")
        constraints = (
            models.UniqueConstraint(fields=("thread_id", "checkpoint_ns", "checkpoint_id"),
                                    name="agentruns_graph_checkpoint"),
        )

    def __str__(self) -> str:
        return f"{self.thread_id}/{self.checkpoint_ns}/{self.checkpoint_id}"


class GraphWrite(models.Model):
    """A pending write of a task, saved before its checkpoint is complete, so a resumed
    graph does not run a finished task again."""

    id = models.BigAutoField(primary_key=True)
    thread_id = models.CharField(max_length=255)
    checkpoint_ns = models.CharField(max_length=255, blank=True, default="")
    checkpoint_id = models.CharField(max_length=64)
    task_id = models.CharField(max_length=255)
    idx = models.IntegerField()
    channel = models.CharField(max_length=255)
    type = models.CharField(max_length=32)
    value = models.BinaryField()
    task_path = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        ordering = ("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx")
        constraints = (
            models.UniqueConstraint(
                fields=("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"),
                name="agentruns_graph_write"),
        )

    def __str__(self) -> str:
        return f"{self.thread_id}/{self.checkpoint_id}/{self.task_id}/{self.idx}"
