"""The stores an asyncio loop can await: the native one a lock URL's backend registers, else
any sync backend run in worker threads (ThreadStore)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from typing import Any, cast

import jobfence.locks.registry as registry
from jobfence.locks.api import open_backend
from jobfence.locks.backend import LockBackend
from jobfence.locks.drive import AsyncStore
from jobfence.locks.ops import StoreOp, WaitRelease


class ThreadStore:
    """Any sync backend, awaited: each op runs in a worker thread (asyncio.to_thread), so
    the loop never blocks on it.

    Cancellation: an op with an effect (acquire, release, extend, a slot) is let finish in
    its thread before the CancelledError goes on, so the flow's clean-up (releasing what
    the op granted) comes after it, never before. Waiting for a release is a plain
    asyncio.sleep (no thread held per waiter; the flow's backoff bounds each pause).
    """

    def __init__(self, backend: LockBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self.capabilities = backend.capabilities
        self.clock = backend.clock

    async def execute_async(self, op: StoreOp) -> Any:
        if type(op) is WaitRelease:
            await asyncio.sleep(op.timeout)
            return None
        job = asyncio.ensure_future(asyncio.to_thread(self.backend.execute, op))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await job  # its effect lands first; the flow then undoes it
            raise

    async def aclose(self) -> None:
        await asyncio.to_thread(self.backend.close)


def open_async_store(url: str, **options: Any) -> AsyncStore:
    """The asyncio store for a lock URL: native where the registry names one (Redis one
    node, Sentinel, Cluster, Redlock; PostgreSQL), a ThreadStore over `open_backend(url)` else."""
    entry = registry.entry_for(url)
    if entry.async_store is not None:
        entry.load()  # its install hint if the backend's library is missing
        module, _, name = entry.async_store.partition(":")
        store: Any = getattr(importlib.import_module(module), name)
        return cast(AsyncStore, store.from_url(url, **options))
    return ThreadStore(open_backend(url, **options))
