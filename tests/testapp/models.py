from django.db import models


class SideEffect(models.Model):
    """One row per step an agent executed: counts real executions across processes."""

    run_id = models.BigIntegerField()
    step = models.IntegerField(default=0)
    attempt = models.IntegerField(default=0)
    worker = models.CharField(max_length=255, blank=True, default="")
    note = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"run {self.run_id} step {self.step} attempt {self.attempt}"
