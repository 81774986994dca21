"""Granting a lock: a multi per try, a busy holder's answer, a stale node, a job record met."""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from jobfence.locks.backend import (
    BeginResult,
    Busy,
    JobRecord,
    default_meta,
    validate_key,
    validate_ttl,
)
from jobfence.locks.backends.zookeeper.core import multi_failure
from jobfence.locks.backends.zookeeper.nodes import Grant, Paths, node_json, node_name, owner_digest
from jobfence.locks.backends.zookeeper.prune import Pruning
from jobfence.locks.backends.zookeeper.session import Session
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease, OwnerMeta, new_owner_token

log = logging.getLogger(__package__)  # one logger for the package's modules

ATTEMPTS = 6  # a begin that keeps meeting a release, a new key node or a cleared record
KNOWN_KEYS = 10_000  # key nodes this process knows exist (a cache, emptied when full)
STALE_MARGIN = 0.5  # a node unextended this long past its TTL (or half the TTL) is no lease's


class Granting(Pruning):
    """ZooKeeperBackend's begin, and the wait for a release after a Busy answer."""

    def begin(
        self,
        key: str,
        ttl: float,
        *,
        meta: OwnerMeta | None = None,
        record: bool = False,
        fingerprint: str = "",
        owner: str | None = None,
    ) -> BeginResult:
        """As LockBackend.begin; the lease's TTL is its session's (the server may round it)."""
        validate_key(key)
        validate_ttl(ttl)
        session = self._session(ttl)
        owner = owner or new_owner_token()
        meta = meta or default_meta()
        started = self.clock.monotonic()
        got = self._grant(session, key, owner, meta, record, fingerprint, started)
        if not isinstance(got, Grant):
            return got
        lease = Lease(
            key=key,
            owner=owner,
            fence=got.fence,
            ttl=session.ttl,
            deadline=started + session.ttl,
            backend=self,
            clock=self.clock,
            meta=meta,
        )
        got.lease = weakref.ref(lease)
        return lease

    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        session = self._session(ttl_ms / 1000)
        got = self._grant(
            session, key, owner, meta, record, fingerprint, self.clock.monotonic()
        )
        return got.fence if isinstance(got, Grant) else got

    def _holder(self, key: str, owner: str, meta: OwnerMeta, ttl_ms: int, fp: str) -> bytes:
        return json.dumps(
            {"key": key, "owner": owner_digest(owner), "task_id": meta.task_id,
             "task_name": meta.task_name, "host": meta.host, "pid": meta.pid,
             "process_start": meta.process_start, "fingerprint": fp, "ttl_ms": ttl_ms},
            separators=(",", ":"),
        ).encode()  # fmt: skip

    def _grant(
        self,
        session: Session,
        key: str,
        owner: str,
        meta: OwnerMeta,
        record: bool,
        fingerprint: str,
        started: float,
    ) -> Grant | Busy | JobRecord:
        name = node_name(key)
        p = self._paths(name)
        data = self._holder(key, owner, meta, session.negotiated_ms, fingerprint if record else "")
        contended = False
        for _ in range(ATTEMPTS):
            ops = self._grant_ops(p, key, name in self._known, record, data)
            got = self._try_grant(session, key, owner, name, p, ops, data, started)
            if isinstance(got, Grant):
                self._known.add(name)
                return got
            index, exc = got
            op = ops[index]
            if self._mend(session, name, p, op, exc):
                continue
            if op[1] == p.job and isinstance(exc, NodeExistsError):
                outcome = self._record_or_clear(session, key, owner, name, p, data, started)
                if outcome is not None:
                    return outcome
                continue
            if op[1] == p.lock and isinstance(exc, NodeExistsError):
                busy = self._busy(session, key, p)
                if busy is not None:
                    return busy
                contended = True  # released between our create and our read: again
                continue
            raise BackendUnavailable(f"zookeeper begin failed: {exc!r}", key=key, cause=exc)
        if contended:  # a key changing hands this fast is busy: the caller backs off
            return Busy(ttl_left=0.0)
        raise BackendUnavailable(f"zookeeper begin did not settle in {ATTEMPTS} tries", key=key)

    @staticmethod
    def _grant_ops(
        p: Paths, key: str, known: bool, record: bool, data: bytes
    ) -> list[tuple[Any, ...]]:
        """The grant multi. A key node seen before: the create plus a set of the key node; a
        job grant first probes for a record (create and delete of `job`). A new key node is
        created in the same multi (it has no record yet)."""
        keyname = key.encode()
        ops: list[tuple[Any, ...]] = []
        if not known:
            ops.append(("create", p.key, keyname))
        elif record:
            ops += [("create", p.job, b""), ("delete", p.job)]
        ops += [("ephemeral", p.lock, data), ("set", p.key, keyname)]
        return ops

    def _mend(
        self, session: Session, name: str, p: Paths, op: tuple[Any, ...], exc: Exception
    ) -> bool:
        """A grant multi failed on the key node or a missing parent: learn that the key node
        exists, or make what is missing. True: try again; False: it failed on something else."""
        if op[0] == "create" and op[1] == p.key:
            if isinstance(exc, NodeExistsError):
                self._remember(name)
            else:
                self._make_bucket(session, p)  # NoNode: the bucket (or everything) is missing
            return True
        if isinstance(exc, NoNodeError):
            if op[1] == p.lock:
                self._setup(session)  # the locks parent is gone: new (or wiped) data
            self._known.discard(name)
            return True
        return False

    def _remember(self, name: str) -> None:
        if len(self._known) >= KNOWN_KEYS:
            self._known.clear()
        self._known.add(name)

    def _try_grant(
        self,
        session: Session,
        key: str,
        owner: str,
        name: str,
        p: Paths,
        ops: list[tuple[Any, ...]],
        data: bytes,
        started: float,
    ) -> Grant | tuple[int, Exception]:
        """Send one grant multi. A node made for no lease (the answer was lost, or the
        fence is refused) is an orphan: the reaper deletes it, owner-checked."""
        if not session.wait_connected(self.socket_timeout):
            raise BackendUnavailable("zookeeper begin: not connected", key=key)
        if self._base_us is None or session.sid not in self._base_seen:
            self._load_base(session)  # before the create: nothing may fail after it
        sid = session.sid  # the session the node will belong to, if it stays the same
        before = time.time()
        try:
            results = self._multi(session, "begin", key, ops)
        except BackendUnavailable as exc:
            if exc.cause is not None:  # it went out: the node may exist, held by no lease
                self._orphan(p, owner)
            raise
        failed = multi_failure(results)
        if failed is not None:
            return failed
        stat = results[-1]  # the key node's: one multi, one zxid, so mzxid = the lock's czxid
        self._note_clock(stat.mtime, before, time.time())
        if sid is None or session.sid != sid or sid not in self._base_seen:
            self._orphan(p, owner)  # the session changed meanwhile
            raise BackendUnavailable("zookeeper begin: the session changed", key=key)
        fence = self._checked_fence(session, key, owner, p, stat.mzxid)
        grant = Grant(
            key=key, owner=owner, name=name, session=session, sid=sid,
            version=stat.version, fence=fence, data=data, deadline=started + session.ttl,
        )  # fmt: skip
        return self._keep(grant)

    def _checked_fence(self, session: Session, key: str, owner: str, p: Paths, zxid: int) -> int:
        """The fence of the grant made by the multi of `zxid`; refused (its node left to the
        reaper) unless above every fence granted on data the server has since lost."""
        fence = self._fence(session, zxid)
        if fence <= self._old_floor:
            # At or below a fence granted on data the server has since lost: the new base
            # is not far enough above the old one (an ensemble's zxids carry its election
            # epoch in their top 32 bits: 2^32 µs, 72 minutes, per election). Refuse.
            self._orphan(p, owner)
            raise BackendUnavailable(
                f"ZooKeeper gave fence {fence}, not above {self._old_floor} seen before: its "
                "data was lost; restore the data directory (or wait: the base is its "
                "creation time in µs)",
                key=key,
            )
        if fence > self.fence_floor:  # racing threads may keep an older grant: a maximum
            self.fence_floor = fence
        return fence

    def _keep(self, grant: Grant) -> Grant:
        """Keep a new grant (the reaper watches it); start a prune when one is due."""
        with self._mutex:
            self._grants[(grant.key, grant.owner)] = grant
        if self.clock.monotonic() >= self._next_prune:
            self._prune_soon()
        return grant

    def _orphan(self, p: Paths, owner: str) -> None:
        with self._mutex:
            if len(self._orphans) < 10_000:  # a server down for long: each try left one
                self._orphans.append((p.lock, owner_digest(owner)))
        self._wake.set()

    def _make_bucket(self, session: Session, p: Paths) -> None:
        try:
            self._create_quietly(session, p.bucket, b"")
        except NoNodeError:
            self._setup(session)

    def _busy(self, session: Session, key: str, p: Paths) -> Busy | None:
        """The holder's task, fingerprint and TTL left; None if it just went (try again).

        The read leaves a watch on the lock node, so the caller's wait_for_release wakes
        when it changes, even if that happens before the wait begins.
        """
        event = threading.Event()
        try:
            data, stat = self._call(
                session, "begin", key,
                lambda: session.client.get_async(p.lock, watch=lambda _e: event.set()),
            )  # fmt: skip
        except NoNodeError:
            return None
        self._waits()[key] = event
        holder = node_json(data)
        ttl = int(holder.get("ttl_ms", session.negotiated_ms)) / 1000
        left = (stat.mtime / 1000 + ttl) - self.server_now()
        if left < -max(STALE_MARGIN, ttl / 2) and self._stale(session, key, p, stat, ttl):
            return None
        return Busy(
            ttl_left=min(ttl, max(0.0, left)),
            task_id=str(holder.get("task_id", "")),
            fingerprint=str(holder.get("fingerprint", "")),
        )

    def _stale(self, session: Session, key: str, p: Paths, stat: Any, ttl: float) -> bool:
        """Delete a lock node nobody extended for well over its TTL; True if it went.

        Its holder's deadline has passed (the node's mtime is later than the holder's last
        confirmed extension), so no lease holds it; its session lives on (a holder process
        whose reaper died, a node whose answer was lost). The server's clock decides, read
        afresh; the delete is conditional on the node's version (not extended meanwhile).
        """
        if self.server_time() < stat.mtime / 1000 + ttl + max(STALE_MARGIN, ttl / 2):
            return False
        try:
            self._call(session, "begin", key,
                       lambda: session.client.delete_async(p.lock, stat.version))  # fmt: skip
        except (NoNodeError, BadVersionError):
            return True
        log.warning("deleted the lock node of %s: not extended for %.3gs past its TTL",
                    key, self.server_now() - stat.mtime / 1000 - ttl)  # fmt: skip
        return True

    def _record(self, data: bytes, stat: Any) -> tuple[JobRecord, bool] | None:
        """The job record in `data` and whether it is still live (None: not a record)."""
        rec = node_json(data)
        if rec.get("state") not in ("DONE", "FAILED"):
            return None
        finished = stat.mtime / 1000
        live = finished + int(rec.get("ttl_ms", 0)) / 1000 > self.server_now()
        return JobRecord(
            state=rec["state"],
            fingerprint=str(rec.get("fingerprint", "")),
            result=str(rec.get("result", "")),
            fence=int(rec.get("fence", 0)),
            finished_at=finished,
        ), live

    def _record_or_clear(
        self,
        session: Session,
        key: str,
        owner: str,
        name: str,
        p: Paths,
        data: bytes,
        started: float,
    ) -> Grant | Busy | JobRecord | None:
        """A job grant met a record: a live DONE answers; anything else is cleared by the
        grant (one multi). None: the record changed meanwhile, start over."""
        try:
            raw, stat = self._call(session, "begin", key, lambda: session.client.get_async(p.job))
        except NoNodeError:
            return None
        found = self._record(raw, stat)
        if found is not None and found[0].state == "DONE" and found[1]:
            return found[0]
        ops = [("check", p.job, stat.version), ("delete", p.job),
               ("ephemeral", p.lock, data), ("set", p.key, key.encode())]  # fmt: skip
        got = self._try_grant(session, key, owner, name, p, ops, data, started)
        if isinstance(got, Grant):
            return got
        index, exc = got
        if ops[index][1] == p.lock and isinstance(exc, NodeExistsError):
            return self._busy(session, key, p)
        return None

    def _waits(self) -> dict[str, threading.Event]:
        """This thread's watches set by refused attempts, by key (bounded: a caller that
        never waits, try_acquire say, leaves them behind)."""
        waits: dict[str, threading.Event] | None = getattr(self._tls, "waits", None)
        if waits is None or len(waits) > 1000:
            waits = self._tls.waits = {}
        return waits

    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block until the lock node of `key` changes (a watch) or `timeout` passes.

        A Busy answer from this thread left a watch (see `_busy`), so a release between the
        refused attempt and this wait is not missed; without one, an `exists` sets it.
        """
        timeout = min(timeout, self._max_block)
        if timeout < 0.001:
            return
        event = self._waits().pop(key, None)
        if event is None:
            session = self._any_session()
            event = threading.Event()
            path = self._paths(node_name(key)).lock
            stat = self._call(
                session, "wait", key,
                lambda: session.client.exists_async(path, watch=lambda _e: event.set()),
            )  # fmt: skip
            if stat is None:
                return
        event.wait(timeout)
