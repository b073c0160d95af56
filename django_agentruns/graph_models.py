"""Tables of LangGraph's checkpoint saver (`integrations.langgraph.AgentRunsSaver`).

A graph's checkpoints belong to its thread (`thread_id`), not to a run: a thread goes on
across runs (a conversation), as with LangGraph's own savers, until the application
deletes it (`AgentRunsSaver().delete_thread(thread_id)`). `run` says which run wrote a
checkpoint (None outside one, or once that run is purged). Values are stored as the
saver's serializer made them (a type tag and bytes).
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


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
