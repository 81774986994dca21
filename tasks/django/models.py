"""The fence and job-record tables as Django models (same names and columns as the SQL ones)."""

from __future__ import annotations

from django.db import models


class Fence(models.Model):  # type: ignore[misc]
    """The highest fencing token accepted per resource (``locks.guards.SqlFenceGuard``)."""

    resource = models.CharField(max_length=255, primary_key=True)
    fence = models.BigIntegerField()

    class Meta:
        db_table = "jobfence_fences"

    def __str__(self) -> str:
        return f"{self.resource} @ {self.fence}"


class JobRecord(models.Model):  # type: ignore[misc]
    """A job's DONE row, committed with its effect (``tasks.effects.SqlEffects``)."""

    job_key = models.CharField(max_length=255, primary_key=True)
    state = models.CharField(max_length=16)
    fingerprint = models.CharField(max_length=64)
    result = models.TextField()
    fence = models.BigIntegerField()
    finished_at = models.FloatField()

    class Meta:
        db_table = "jobfence_jobs"

    def __str__(self) -> str:
        return f"{self.state} fence={self.fence}"


class OutboxMessage(models.Model):  # type: ignore[misc]
    """A message published on commit (``tasks.outbox``): written in the caller's transaction,
    marked sent once published, pruned by the relay."""

    task_id = models.CharField(max_length=64, primary_key=True)
    task_name = models.CharField(max_length=255)
    payload = models.TextField()
    created_at = models.FloatField()
    sent_at = models.FloatField(null=True)
    attempts = models.IntegerField(default=0)

    class Meta:
        db_table = "jobfence_outbox"
        indexes = [models.Index(fields=["sent_at", "created_at"], name="jobfence_outbox_unsent")]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] {'sent' if self.sent_at else 'unsent'}"
