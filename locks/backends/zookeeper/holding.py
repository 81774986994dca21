"""A held lock: extend, release and commit, each a multi checked against the key node's version."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kazoo.exceptions import NodeExistsError, NoNodeError

from jobfence.locks.backend import CommitRecord, validate_ttl
from jobfence.locks.backends.zookeeper.core import Core, multi_failure
from jobfence.locks.backends.zookeeper.nodes import Grant
from jobfence.locks.errors import LockError, NotOwner
from jobfence.locks.lease import Lease

MAX_RECORD_BYTES = 512 * 1024  # ZooKeeper refuses packets over jute.maxbuffer (1 MB)


class Holding(Core):
    """ZooKeeperBackend's calls on a lock this process holds."""

    def _mine(self, key: str, owner: str) -> Grant | None:
        """Our grant for (key, owner) while its session lives and its deadline has not passed
        (past it, the reaper deletes the node: it is no longer ours to use)."""
        grant = self._grants.get((key, owner))
        if grant is None or not grant.valid() or grant.reaping:
            return None
        if self.clock.monotonic() >= grant.deadline:
            self._wake.set()
            return None
        return grant

    def extend(self, lease: Lease, ttl: float | None = None) -> None:
        """Renew for the lease's TTL: its session's timeout, whatever `ttl` asks."""
        validate_ttl(ttl if ttl is not None else lease.ttl)
        started = self.clock.monotonic()
        if not self._extend(lease.key, lease.owner, 0):
            err = NotOwner("extend refused: not the owner", key=lease.key, fence=lease.fence)
            lease.mark_lost(err)
            raise err
        grant = self._grants.get((lease.key, lease.owner))
        lease.renewed(started, grant.session.ttl if grant is not None else lease.ttl)

    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self._extend_many([(key, owner, ttl_ms)])[0]

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        """One multi per session (one in all, usually): check each key node's version and
        rewrite the lock node (its mtime is the heartbeat). A multi is all or nothing, so a
        lease found lost costs one more multi for the others."""
        started = self.clock.monotonic()
        results = [False] * len(items)
        groups: dict[int, list[tuple[int, Grant]]] = {}
        for i, (key, owner, _) in enumerate(items):
            grant = self._mine(key, owner)
            if grant is not None:
                groups.setdefault(id(grant.session), []).append((i, grant))
        for group in groups.values():
            session = group[0][1].session
            while group:
                ops: list[tuple[Any, ...]] = []
                for _, g in group:
                    p = self._paths(g.name)
                    ops += [("check", p.key, g.version), ("set", p.lock, g.data)]
                answer = self._multi(session, "extend", group[0][1].key, ops)
                failed = multi_failure(answer)
                if failed is None:
                    for i, g in group:
                        results[i] = True
                        if g.valid():
                            g.deadline = started + session.ttl
                    break
                group.pop(failed[0] // 2)  # not ours any more: the others go again
        return results

    def _release(self, key: str, owner: str) -> bool:
        grant = self._grants.get((key, owner))
        mine = self._mine(key, owner)
        if mine is None:
            if grant is not None:
                self._wake.set()  # past its deadline: the reaper deletes the node
            return False
        p = self._paths(mine.name)
        answer = self._multi(
            mine.session, "release", key, [("check", p.key, mine.version), ("delete", p.lock)]
        )
        with self._mutex:
            self._grants.pop((key, owner), None)
        return multi_failure(answer) is None

    def _commit(self, rec: CommitRecord) -> bool:
        key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
        record = json.dumps(
            {"key": key, "state": state, "fingerprint": fingerprint, "result": result,
             "fence": fence, "ttl_ms": result_ttl_ms},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        if len(record) > MAX_RECORD_BYTES:
            raise LockError(
                f"job result of {len(record)} bytes is too large for ZooKeeper (at most "
                f"{MAX_RECORD_BYTES}); return a smaller result (an id, not the data)",
                key=key,
                fence=fence,
            )
        mine = self._mine(key, owner)
        if mine is None:
            if (key, owner) in self._grants:
                self._wake.set()
            return False
        p = self._paths(mine.name)
        ok = False
        for write in ("create", "set") * 2:  # a plain lock's key may hold an older record
            ops = [("check", p.key, mine.version), (write, p.job, record), ("delete", p.lock)]
            failed = multi_failure(self._multi(mine.session, "commit", key, ops))
            if failed is None:
                ok = True
                break
            if failed[0] != 1 or not isinstance(failed[1], NodeExistsError | NoNodeError):
                break
        with self._mutex:
            if ok:
                self._grants.pop((key, owner), None)
        return ok
