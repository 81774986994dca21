"""The two drivers of a flow (locks/flows.py): the only loops that do I/O, sync and asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from jobfence.locks.clock import Clock
from jobfence.locks.flows import Flow
from jobfence.locks.ops import Now, Sleep, StoreOp

T = TypeVar("T")


class Store(Protocol):
    """What the sync driver needs: one round trip per op (LockBackend.execute)."""

    def execute(self, op: StoreOp) -> Any: ...


class AsyncStore(Protocol):
    """What the asyncio driver needs: one awaited round trip per op."""

    async def execute_async(self, op: StoreOp) -> Any: ...


def run_sync(flow: Flow[T], store: Store, clock: Clock) -> T:
    """Run `flow` to its value in this thread: each op one call of `store.execute`, sleeps
    on `clock`. A failure (or KeyboardInterrupt) is thrown into the flow, to clean up."""
    send, execute = flow.send, store.execute  # looked up once: a job sends a dozen ops
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = reply = None
        try:
            kind = type(op)
            if kind is Now:
                reply = clock.monotonic()
            elif kind is Sleep:
                clock.sleep(op.seconds)  # type: ignore[union-attr]
            else:
                reply = execute(op)  # type: ignore[arg-type]
        except BaseException as exc:  # the flow decides: clean up, retry or raise
            error = exc


async def deliver_cancel(awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; if this task was cancelled meanwhile and the CancelledError was lost
    on the way up, raise it now, so a cancel always ends the wait.

    Python 3.11's asyncio.wait_for returns its inner result and drops a cancel that lands in
    the loop tick the result arrives in (CPython gh-86296, fixed in 3.12); redis.asyncio
    wraps every socket write in one, so now and then a cancel was lost mid-op. A lost
    cancel leaves the task's `cancelling()` count raised: compare it before and after."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    result = await awaitable
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return result


async def run_async(flow: Flow[T], store: AsyncStore, clock: Clock) -> T:
    """Run `flow` to its value on the running loop: each op one awaited round trip, sleeps
    through asyncio.sleep. A cancellation is thrown into the flow, which may still send its
    clean-up (a release, leaving a queue) before the CancelledError goes on; one that a
    client library lost mid-op is raised when the op returns (deliver_cancel)."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = flow.send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = reply = None
        try:
            kind = type(op)
            if kind is Now:
                reply = clock.monotonic()
            elif kind is Sleep:
                await asyncio.sleep(op.seconds)  # type: ignore[union-attr]
            else:
                reply = await deliver_cancel(store.execute_async(op))  # type: ignore[arg-type]
        except BaseException as exc:  # CancelledError too: the flow cleans up, then re-raises
            error = exc
