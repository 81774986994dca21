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
