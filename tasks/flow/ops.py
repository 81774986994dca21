"""What the shell does for a job flow (no store round trip): keep, drop, run the body, and so on."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from jobfence.locks.lease import Lease
from jobfence.locks.ops import Op
from jobfence.tasks.context import JobContext
from jobfence.tasks.events import Event


@dataclass(slots=True)
class Keep:
    """Have the keeper renew `lease` until dropped; a loss of it marks `tie` lost too (a
    concurrency slot: past it the job may be one too many, so it stops as if its lease went)."""

    lease: Lease
    tie: Lease | None = None
    watch: bool = False  # may be evicted (supersede): heard at once where the backend says


@dataclass(slots=True)
class Drop:
    """Stop renewing `lease` (it is released, committed or given up)."""

    lease: Lease


@dataclass(slots=True)
class RunBody:
    """Run the job's body with `ctx` as the current job; the reply is its value, or what it
    raised is thrown into the flow."""

    ctx: JobContext


@dataclass(slots=True)
class AfterOuterCommit:
    """The body's effect committed into callers' transactions (`ctx.outer`): once every one
    commits, store the DONE record (`record_done_flow`), best effort, from their hook."""

    ctx: JobContext
    result: str


ShellOp = Keep | Drop | RunBody | Event | AfterOuterCommit
JobOp = Op | ShellOp
T = TypeVar("T")
#: A job flow: yields store and shell ops, is sent each reply, returns its value.
JobFlow = Generator[JobOp, Any, T]
