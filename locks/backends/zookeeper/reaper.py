"""The reaper thread: leases whose session ended or deadline passed, nodes made for no lease."""

from __future__ import annotations

import logging
import threading

from kazoo.exceptions import BadVersionError, NoNodeError

from jobfence.locks.backends.zookeeper.core import Core
from jobfence.locks.backends.zookeeper.nodes import Grant, node_json
from jobfence.locks.errors import BackendUnavailable, LeaseLost
from jobfence.locks.lease import DRIFT_FLOOR, DRIFT_FRACTION

log = logging.getLogger(__package__)  # one logger for the package's modules


class Reaping(Core):
    """ZooKeeperBackend's reaper: one thread a process, woken by a session's change."""

    def _start_reaper(self) -> None:
        self._stopping = False
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(
                target=self._reap_loop, name="jobfence-zookeeper-reaper", daemon=True
            )
            self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stopping:
            try:
                wait = self._reap()
            except Exception:  # never die silently: a missed deadline would leave a lock
                log.exception("zookeeper reaper pass failed")
                wait = 0.5
            self._wake.wait(wait)
            self._wake.clear()

    def _reap(self) -> float:
        """One pass; returns seconds until the next thing falls due."""
        now = self.clock.monotonic()
        next_at = now + 1.0
        for session in list(self._sessions.values()):
            if session.dead:
                continue
            down = session.down_since
            if down is not None and now - down > session.ttl:
                # Cut off longer than the session could live: drop the client (a wiped
                # server refuses its reconnection for ever) and start afresh on next use.
                session.retire()
        with self._mutex:
            grants = list(self._grants.values())
            orphans, self._orphans = self._orphans, []
        for grant in grants:
            next_at = min(next_at, self._reap_grant(grant, now))
        kept = [o for o in orphans if not self._reap_orphan(*o)]
        if kept:
            with self._mutex:
                self._orphans.extend(kept)
            next_at = min(next_at, now + 0.2)
        with self._mutex:
            for ms, session in list(self._sessions.items()):
                if session.dead:
                    del self._sessions[ms]
        return max(0.001, next_at - self.clock.monotonic())

    def _reap_grant(self, grant: Grant, now: float) -> float:
        """Mark the lease lost when due; delete its node past the deadline. Next due time.

        Curator's rule (SUSPENDED: the lock may be gone; LOST: it is) holds by construction.
        A lease's deadline is the send time of its last confirmed request plus the session
        timeout, and the server can expire the session only that long after it last heard
        from us, so while the connection is down the lease is marked lost at its deadline
        (less the drift), before its session may expire; an ended session (LOST, or a new
        session id) marks it lost at once. A reconnection in time rides through.
        """
        session = grant.session
        lease = grant.lease() if grant.lease is not None else None
        if not grant.valid():
            self._forget(grant)
            if lease is not None:
                lease.mark_lost(
                    LeaseLost("the ZooKeeper session ended", key=grant.key, fence=grant.fence)
                )
            return now + 1.0
        lost_at = grant.deadline - (session.ttl * DRIFT_FRACTION + DRIFT_FLOOR)
        if now >= lost_at and lease is not None and not lease.released:
            lease.mark_lost(
                LeaseLost(
                    "cut off from ZooKeeper until the lease's deadline: its session may expire"
                    if session.down_since is not None
                    else "lease deadline passed before an extension was confirmed",
                    key=grant.key,
                    fence=grant.fence,
                )
            )
        if now < grant.deadline:
            return lost_at if now < lost_at else grant.deadline
        return self._delete_past_deadline(grant, now)

    def _delete_past_deadline(self, grant: Grant, now: float) -> float:
        """Delete the node of a grant past its deadline (owner-checked). Next due time."""
        session = grant.session
        if not session.connected:
            return now + 0.2
        grant.reaping = True
        p = self._paths(grant.name)
        try:
            self._multi(session, "reap", grant.key,
                        [("check", p.key, grant.version), ("delete", p.lock)])  # fmt: skip
        except BackendUnavailable:
            grant.reaping = False
            return now + 0.2
        self._forget(grant)
        return now + 1.0

    def _forget(self, grant: Grant) -> None:
        with self._mutex:
            if self._grants.get((grant.key, grant.owner)) is grant:
                del self._grants[(grant.key, grant.owner)]

    def _reap_orphan(self, path: str, digest: str) -> bool:
        """Delete a node a grant made for no lease (its answer lost, its fence refused, its
        session changed under it); True once settled. The owner digest says it is that
        grant's node, whichever of our sessions made it; gone is settled too."""
        session = next((s for s in list(self._sessions.values()) if s.connected), None)
        if session is None:
            return False
        try:
            data, stat = self._call(session, "reap", None, lambda: session.client.get_async(path))
            if node_json(data).get("owner") == digest:
                self._call(session, "reap", None,
                           lambda: session.client.delete_async(path, stat.version))  # fmt: skip
        except (NoNodeError, BadVersionError):
            pass
        except BackendUnavailable:
            return False
        return True
