"""The asyncio Redlock store: the sync backend's rounds (scripts, quorum, fence) on asyncio."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

from redis.exceptions import RedisError

from jobfence.locks import ops
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    NativeAsyncStore,
    Security,
    check_swap,
    settle_extensions,
    validate_key,
    validate_ttl,
)
from jobfence.locks.backends.redis.signal_wait import SignalWait
from jobfence.locks.backends.redlock.masters_async import AsyncMaster, Conn
from jobfence.locks.backends.redlock.protocol import NO_REPLY, is_noscript, pack
from jobfence.locks.backends.redlock.rounds import Done, Round, Rounds, advance
from jobfence.locks.backends.redlock.store import RedlockBackend
from jobfence.locks.errors import LockError
from jobfence.locks.lease import Lease, OwnerMeta

T = TypeVar("T")


class AsyncRedlockStore(NativeAsyncStore):
    """Redlock for asyncio: every op is one of RedlockBackend's flows of rounds (the same
    scripts, keys, quorum, validity and fence), each round sent to the N masters at once
    on one pipelined connection per master and awaited until decided or its deadline. So
    sync and async holders of one key exclude each other and share one fence space.

    Cancellation: an op that is cancelled stops waiting; a grant cancelled mid-way queues
    its release on every master behind its own commands (so it runs after them), as an
    interrupted sync grant does. A master that does not answer (down, SIGSTOPped) costs an
    op at most its deadline, and the loop nothing.

    It keeps a RedlockBackend on the same masters (`backend`, connected only if used) for
    the flows, the key layout and the fence floor; its leases name that backend, so
    `lease.release()` from a thread still works.
    """

    backend: RedlockBackend  # the sync twin (NativeAsyncStore)
    name: ClassVar[str] = "redlock"
    capabilities: ClassVar[Capabilities] = RedlockBackend.capabilities

    def __init__(self, backend: RedlockBackend, *, max_connections: int = 32) -> None:
        self.backend = backend
        self.keys = backend.keys
        self.clock = backend.clock
        self.masters = [
            AsyncMaster(m, backend.socket_timeout, max_connections) for m in backend.masters
        ]
        self._signals = SignalWait(max_connections, backend.socket_timeout)
        self._wait_on = 0  # the master waiters block on; moves on when it fails

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 32, **options: Any) -> AsyncRedlockStore:
        """`redlock://[user:password@]host:port,host:port,host:port[,...][/db]`; `options`
        are RedlockBackend.from_url's (prefix, socket_timeout, fence_retention, clock ...)."""
        return cls(RedlockBackend.from_url(url, **options), max_connections=max_connections)

    async def execute_async(self, op: ops.StoreOp) -> Any:
        """One op (locks/ops.py); the replies are RedlockBackend.execute's."""
        backend = self.backend
        match op:
            case ops.Begin():
                return await self.begin_op(op)
            case ops.Commit():
                return await self.commit_op(op)
            case ops.Acquire(key, ttl, owner, meta):
                return await self._begin(key, ttl, owner, meta, False, "")
            case ops.WaitRelease(key, timeout):
                return await self._wait(key, timeout)
            case ops.Extend(leases):
                return await self._extend(leases)
            case ops.Release(lease):
                return await self._release(lease)
            case ops.ReleaseOwner(key, owner):
                validate_key(key)
                return await self._run(backend.release_rounds(key, owner))
            case ops.Inspect(key):
                validate_key(key)
                return await self._run(backend.inspect_rounds(key))
            case ops.ReleaseGrant(key, fence):  # rare (a supersede): in a worker thread
                return await asyncio.to_thread(backend.release_grant, key, fence)
            case ops.ClaimPublish(key, task_id, ttl):
                return await self._run(backend.claim_publish_rounds(key, task_id, ttl))
            case ops.SwapPublish(key, expect, new, ttl):
                ttl_ms = check_swap(key, expect, new, ttl)
                return await self._run(backend.swap_publish_rounds(key, expect, new, ttl_ms))
            case ops.ClearPublish(key):
                return await self._run(backend.clear_publish_rounds(key))
            case ops.ReadRecord(key):
                validate_key(key)
                return await self._run(backend.job_record_rounds(key))
            case ops.CountDelivery(key, window):
                validate_key(key)
                return await self._run(backend.count_delivery_rounds(key, validate_ttl(window)))
            case ops.TakeSlot() | ops.LeaveSlot() | ops.TakeRate():
                return backend.execute(op)  # refused before any I/O: Redlock keeps neither
        raise LockError(f"the asyncio redlock store cannot run {type(op).__name__}")

    async def _extend(self, leases: Sequence[Lease]) -> list[bool]:
        """Extend every lease in one round; which of them a majority extended."""
        if not leases:
            return []
        started = self.clock.monotonic()
        items = [(le.key, le.owner, validate_ttl(le.ttl)) for le in leases]
        extended = await self._run(self.backend.extend_many_rounds(items))
        return settle_extensions(leases, extended, started)

    async def _release(self, lease: Lease) -> bool:
        """Release `lease` once (owner-checked); it counts as released whatever the reply."""
        if lease.released:
            return False
        try:
            return await self._run(self.backend.release_rounds(lease.key, lease.owner))
        finally:
            lease._released = True

    async def _grant(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        return await self._run(
            self.backend.begin_rounds(key, owner, ttl_ms, meta, record, fingerprint)
        )

    async def _commit(self, rec: CommitRecord) -> bool:
        return await self._run(self.backend.commit_rounds(rec))

    async def _run(self, flow: Rounds[T]) -> T:
        """Carry `flow`'s rounds on the loop; a cancellation is thrown into it to clean up."""
        replies: Any = None
        error: BaseException | None = None
        while not isinstance(step := advance(flow, replies, error), Done):
            replies = error = None
            try:
                replies = await self._round(step)
            except BaseException as exc:  # CancelledError too: the flow frees what it may hold
                error = exc
        return step.value

    async def _conns(self, deadline: float) -> list[Conn | None]:
        """Each master's connection; those not connected yet are awaited until `deadline`
        (0: not at all, as for a clean-up that must not wait)."""
        if deadline:
            pending = [t for m in self.masters if (t := m.connect_task()) is not None]
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        return [m.live() for m in self.masters]

    async def _round(self, step: Round) -> dict[int, Any]:
        """As RedlockBackend._round: the payload to every target master at once, replies
        read until the round is decided or its deadline; NO_REPLY for those still silent."""
        self.backend.rounds += 1
        conns = await self._conns(step.deadline)
        payload = step.payload
        replies: dict[int, Any] = {}
        pending: dict[asyncio.Future[Any], int] = {}
        for i in range(len(conns)) if step.targets is None else step.targets:
            conn = conns[i]
            future = conn.send(payload) if conn is not None else None
            if future is None:
                replies[i] = NO_REPLY
            else:
                pending[future] = i
        reloaded: set[int] = set()
        while pending and not step.decided(replies, len(pending)):
            left = step.deadline - time.monotonic()
            if left <= 0:
                break
            done, _ = await asyncio.wait(pending, timeout=left,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            for future in done:
                i = pending.pop(future)
                value = future.result()
                conn = conns[i]
                if is_noscript(value) and i not in reloaded and conn is not None:
                    # The master lost its scripts: load them and resend, in order.
                    reloaded.add(i)
                    loads = self.masters[i].master.script_loads()
                    again = conn.send(b"".join([*loads, payload]), dropped=len(loads))
                    if again is not None:
                        pending[again] = i
                        continue
                replies[i] = value
        for i in pending.values():
            replies[i] = NO_REPLY
        return replies

    async def _wait(self, key: str, timeout: float) -> None:
        """BLPOP the key's signal on one master, as RedlockBackend.wait_for_release; if
        that master fails, the next one is used from the next wait on, and this one sleeps."""
        index = self.backend.wait_master(key)
        try:
            await self._signals.wait(self.masters[index].client, self.keys.signal(key), timeout)
        except RedisError:
            self._wait_on = index + 1
            await asyncio.sleep(min(timeout, self._signals.max_block))

    def security(self) -> Security:
        """The sync backend's: the same masters, URLs and TLS."""
        return self.backend.security()

    async def aclose(self) -> None:
        """Wait briefly for the replies still owed (so what was sent has run), then close."""
        conns = [c for m in self.masters if (c := m.live()) is not None and c.owed]
        owed = [f for c in conns if (f := c.send(pack("PING"))) is not None]
        if owed:
            await asyncio.wait(owed, timeout=min(self.backend.socket_timeout, 1.0))
        for master in self.masters:
            await master.aclose()
        await asyncio.to_thread(self.backend.close)
