"""The asyncio lease keeper: one task extends an AsyncLocker's leases on the thread keeper's
schedule (locks/keeper.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from jobfence.locks.clock import Clock
from jobfence.locks.drive import AsyncStore, deliver_cancel
from jobfence.locks.keeper import (
    MAX_SLEEP,
    deadline_loss,
    first_due,
    next_due,
    pick_batch,
    retry_due,
    time_left,
)
from jobfence.locks.lease import Lease
from jobfence.locks.ops import Extend

log = logging.getLogger("jobfence.locks.aio")  # the name it logged under before the split


class AsyncKeeper:
    """Extends an AsyncLocker's leases from one asyncio task, on the thread keeper's pure
    schedule (locks/keeper.py): one batched Extend per due batch, a retry soon after a
    failure, loss at the deadline. The task starts with the first lease and ends when none
    is left, so no keeper task outlives the leases it keeps."""

    def __init__(self, store: AsyncStore, clock: Clock, *, fraction: float = 1 / 3) -> None:
        if not 0 < fraction < 0.5:
            raise ValueError(f"keeper fraction must be in (0, 0.5), got {fraction}")
        self.store = store
        self.clock = clock
        self.fraction = fraction
        self._due: dict[Lease, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    def keep(self, lease: Lease) -> None:
        self._due[lease] = first_due(self.clock.monotonic(), lease, self.fraction)
        loop = asyncio.get_running_loop()
        task = self._task
        # A task of a loop that has ended (a second asyncio.run) never runs again: replace it.
        if task is None or task.done() or task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="jobfence-async-keeper")
        elif self._wake is not None:
            self._wake.set()

    def drop(self, lease: Lease) -> None:
        self._due.pop(lease, None)
        if not self._due and self._wake is not None:
            self._wake.set()  # the task ends now, not at its next tick

    def held(self) -> list[Lease]:
        return list(self._due)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        self._due.clear()
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while self._due:
            try:
                wait = await self._tick()
            except Exception:  # never die silently: log, and keep keeping
                log.exception("asyncio lease keeper tick failed")
                wait = 0.05
            if not self._due:
                return
            wake = self._wake
            assert wake is not None
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):  # no helper task, unlike wait_for
                    await wake.wait()

    async def _tick(self) -> float:
        now = self.clock.monotonic()
        live: list[tuple[Lease, float]] = []
        next_wake = MAX_SLEEP
        for lease, due in list(self._due.items()):
            left = time_left(lease, now)
            if left <= 0 or lease.settled:
                if left <= 0 and not lease.released:
                    lease.mark_lost(deadline_loss(lease))
                del self._due[lease]
                continue
            next_wake = min(next_wake, left)
            live.append((lease, due))
        batch, wait = pick_batch(live, now, self.fraction)
        if not batch:
            return max(0.001, min(next_wake, wait))
        try:
            # Marks refused leases lost.
            await deliver_cancel(self.store.execute_async(Extend(tuple(batch))))
        except Exception as exc:  # unknown outcome: the lease may still be ours; retry soon
            log.warning("asyncio lease extension failed for %d lease(s), retrying: %s",
                        len(batch), type(exc).__name__)  # fmt: skip
            after = self.clock.monotonic()
            for lease in batch:
                if lease in self._due:
                    self._due[lease] = retry_due(after, lease, self.fraction)
            return 0.001
        for lease in batch:
            if lease in self._due:
                self._due[lease] = next_due(now, lease, self.fraction)
        return 0.001
