"""The peer's own table for the LLM-shaped workload: procrastinate has no event stream, so
its job writes one row per step here, as a user of a plain job queue would."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class Step(models.Model):
    job_id = models.BigIntegerField()
    step = models.PositiveSmallIntegerField()
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.step}"
