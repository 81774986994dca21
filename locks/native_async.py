"""The base of the native asyncio stores (redis.asyncio, psycopg's async connection, Redlock's
rounds on a loop): LockBackend's begin and commit bookkeeping, around an awaited round trip."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from jobfence.locks.clock import Clock
from jobfence.locks.lease import OwnerMeta, new_owner_token
from jobfence.locks.ops import Begin, Commit
from jobfence.locks.replies import BeginResult, Busy, CommitRecord, JobRecord
from jobfence.locks.validation import commit_record, grant_args

if TYPE_CHECKING:  # only types: that module imports this one
    from jobfence.locks.backend import LockBackend


class NativeAsyncStore(ABC):
    """What a native asyncio store (redis.asyncio, psycopg's async connection, Redlock's
    rounds on a loop) shares with LockBackend's begin and commit: the validation, the Lease
    of a grant (naming the sync twin `backend`, so `lease.release()` from a thread works)
    and the commit's bookkeeping. Each store awaits the one round trip itself (`_grant`,
    `_commit`), as a LockBackend makes it in `_begin` and `_commit`."""

    backend: LockBackend
    clock: Clock

    async def begin_op(self, op: Begin) -> BeginResult:
        return await self._begin(op.key, op.ttl, new_owner_token(), op.meta, op.record,
                                 op.fingerprint)  # fmt: skip

    async def commit_op(self, op: Commit) -> bool:
        ok = await self._commit(
            commit_record(op.lease, op.state, op.result, op.fingerprint, op.result_ttl)
        )
        op.lease._released = True
        return ok

    async def _begin(
        self, key: str, ttl: float, owner: str, meta: OwnerMeta | None, record: bool,
        fingerprint: str,
    ) -> BeginResult:  # fmt: skip
        """As LockBackend.begin (an Acquire is a begin without a record)."""
        ttl_ms, meta = grant_args(key, ttl, meta)
        started = self.clock.monotonic()
        got = await self._grant(key, owner, ttl_ms, meta, record, fingerprint)
        if isinstance(got, int):
            return self.backend.lease(key, owner, got, ttl_ms, started, meta)
        return got

    @abstractmethod
    async def _grant(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        """One round trip: the new fence on a grant, Busy, or the job record if DONE."""

    @abstractmethod
    async def _commit(self, rec: CommitRecord) -> bool:
        """One round trip: store `rec` and release, if `rec.owner` still holds the lock."""
