"""ZooKeeperBackend: its parts assembled, built from a URL; its start-up checks and closing."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import ClassVar, Unpack

from jobfence.config.findings import Finding, LockTarget
from jobfence.locks.backend import Capabilities
from jobfence.locks.backends.common import PrunedUrlOptions, server_findings, url_options
from jobfence.locks.backends.zookeeper.core import PRUNE_INTERVAL
from jobfence.locks.backends.zookeeper.holding import Holding
from jobfence.locks.backends.zookeeper.records import Reading
from jobfence.locks.backends.zookeeper.tls import TLSRefused
from jobfence.locks.backends.zookeeper.url import parse_target
from jobfence.locks.errors import BackendUnavailable, LockError


class ZooKeeperBackend(Reading, Holding):
    """Locks on a ZooKeeper server or ensemble. Build with `from_url`.

    Layout under ``[/chroot]/<prefix>`` (a ``<name>`` is the key's SHA-256, 32 hex digits;
    the plain key is in the node data):

    * ``fence-base``: made once per deployment; its ctime (server clock, ms) times 1000 is
      the base of every fence, so a fresh data directory, whose zxids start again at 1,
      re-bases its fences above the earlier ones (DESIGN §4, one fence space).
    * ``locks/<name>``: the lock, an ephemeral node of the holder's session; data: holder JSON
      (key, task, host, pid, a digest of the owner token, TTL). Fence = base + its czxid.
    * ``keys/<2 hex>/<name>``: the key node, persistent; every grant sets it in the same multi
      as the create, so its version counts the key's grants (the owner check of release,
      extend and commit: ``check(key node, version)``) and its new mzxid is the lock's czxid.
      Children: ``job`` (DONE/FAILED record), ``queued`` (published task id), ``deliveries``.

    The session is the lease: one session per process and TTL (its negotiated timeout is the
    TTL every lease on it reports). A holder that dies, freezes or is cut off loses its locks
    when the server expires its session; a live holder that stops extending a lease has its
    node deleted at the lease's deadline by this process's reaper thread.

    Clients are made lazily in each process (kazoo runs threads, which a fork does not
    copy): a forked child starts with none and never touches its parent's.
    """

    name: ClassVar[str] = "zookeeper"
    # ha: an ensemble of 2f+1 servers survives f failures (a URL naming one server is as
    # available as that server). durable_fence: the zxid counter lives in the transaction
    # log; a lost data directory re-bases fences above the old ones (see fence-base).
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=True, release_notify=True
    )

    @classmethod
    def from_url(cls, url: str, **options: Unpack[PrunedUrlOptions]) -> ZooKeeperBackend:
        """`zookeeper://[user:password@]host:port[,host:port...][/chroot][?TLS options]`
        (`parse_target`); a missing chroot is created."""
        try:
            target = parse_target(url)
        except ValueError as exc:
            raise LockError(str(exc)) from exc
        o = url_options(options)
        return cls(
            target.hosts,
            chroot=target.chroot,
            auth=target.auth,
            tls=target.tls,
            prefix=o.prefix,
            socket_timeout=o.socket_timeout,
            fence_retention=o.fence_retention,
            prune_interval=options.get("prune_interval", PRUNE_INTERVAL),
            clock=o.clock,
        )

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        """Its session bounds would stretch none of the app's lease TTLs (`server_problems`)."""
        return server_findings(target, lambda: self.server_problems(target.ttls))

    def server_problems(self, ttls: Sequence[float] = ()) -> list[tuple[str, str]]:
        """(problem, fix) pairs: TTLs the server would stretch (its session bounds).

        Raises BackendUnavailable if the server does not answer.
        """
        problems = []
        opened = set(self._sessions)
        try:
            try:
                granted_ttls = [(ttl, self.session_ttl(ttl)) for ttl in sorted(set(ttls))]
                session = self._any_session()
            except TLSRefused as exc:
                return [(exc.problem, exc.fix)]
            try:
                self._check_acl(session)
            except LockError as exc:
                if isinstance(exc, BackendUnavailable):
                    raise
                problems.append(self._not_ours("writes"))
        finally:
            self._close_unused(opened)  # a prefork parent then forks with no client threads
        for ttl, granted in granted_ttls:
            if granted > ttl + 0.0005:
                problems.append((
                    f"the ZooKeeper server grants sessions of at least {granted:g}s, so leases "
                    f"of {ttl:g}s would last {granted:g}s: a dead holder keeps its locks that "
                    "long, past what the other settings were checked against",
                    f"raise the TTL to {granted:g}s or more, or lower the server's "
                    "minSessionTimeout (zoo.cfg; 2 x tickTime by default)",
                ))  # fmt: skip
        return problems

    def _close_unused(self, keep: set[int]) -> None:
        """Stop the sessions opened since `keep` that hold no lock."""
        with self._mutex:
            used = {id(g.session) for g in self._grants.values()}
            used |= {id(s) for ms, s in self._sessions.items() if ms in keep}  # shared
            idle = [(ms, s) for ms, s in self._sessions.items() if id(s) not in used]
            for ms, _ in idle:
                del self._sessions[ms]
        for session in {id(s): s for _, s in idle}.values():
            session.stop()

    def close(self) -> None:
        if self._pid != os.getpid():
            self._reset(forked=True)
            return
        self._stopping = True
        self._wake.set()
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(2.0)
        with self._mutex:
            sessions, self._sessions = list(self._sessions.values()), {}
            self._grants.clear()
        for session in sessions:
            session.stop()
