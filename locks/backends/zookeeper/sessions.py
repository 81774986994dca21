"""Sessions and set-up: a session per lease TTL, the ACL check, the server clock, the fence base."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError
from kazoo.security import ACL, Permissions

from jobfence.locks.backend import validate_ttl
from jobfence.locks.backends.zookeeper.reaper import Reaping
from jobfence.locks.backends.zookeeper.session import Session
from jobfence.locks.backends.zookeeper.tls import TLSRefused
from jobfence.locks.errors import BackendUnavailable, LockError

log = logging.getLogger(__package__)  # one logger for the package's modules

ADMIN_TTL = 10.0  # the session of a process that holds no lease (CLI, admin calls)


def _writable(acls: Sequence[ACL], scheme: str, ident: str) -> bool:
    """Does an ACL entry give `scheme:ident` write access?"""
    return any(
        a.id.scheme == scheme and a.id.id == ident and a.perms & Permissions.WRITE for a in acls
    )


class Sessions(Reaping):
    """ZooKeeperBackend's sessions (connected on first use) and the nodes they set up."""

    def _session(self, ttl: float) -> Session:
        """The session for leases of `ttl` seconds, connected (made on first use)."""
        if self._pid != os.getpid():
            self._reset(forked=True)
        ms = validate_ttl(ttl)
        session = self._sessions.get(ms)
        if session is not None and not session.dead:
            return session
        with self._connecting:  # one connection at a time; the reaper never waits for it
            session = self._sessions.get(ms)
            if session is None or session.dead:
                if session is not None:
                    session.retire()
                session = self._connect(ms)
                with self._mutex:
                    self._sessions[ms] = session
        return session

    def _connect(self, ms: int) -> Session:
        for name in ("ca", "certfile", "keyfile"):
            path = self.tls_options.get(name)
            if path is not None and not os.access(path, os.R_OK):
                why = "does not exist" if not os.path.exists(path) else "cannot be read"
                raise TLSRefused(f"the lock URL's {name}={path} {why}",
                                 f"give {name}= a readable PEM file's path")  # fmt: skip
        session = Session(self.hosts, ms, self.socket_timeout, self.clock, self._client_options)
        session.start()
        for other in list(self._sessions.values()):
            if not other.dead and other.negotiated_ms == session.negotiated_ms:
                session.stop()  # the server granted a TTL a session already has: share it
                return other
        session.on_change = self._wake.set
        if session.negotiated_ms != ms and ms not in self._warned_ttl:
            self._warned_ttl.add(ms)
            log.warning(
                "ZooKeeper granted a session timeout of %.3gs for a lease TTL of %.3gs "
                "(its minSessionTimeout/maxSessionTimeout): leases of that TTL last %.3gs",
                session.ttl, ms / 1000, session.ttl,
            )  # fmt: skip
        self._start_reaper()
        return session

    def _any_session(self) -> Session:
        """A session for calls that hold nothing (inspect, records, waiting)."""
        if self._pid == os.getpid():
            for session in list(self._sessions.values()):
                if session.connected:
                    return session
        return self._session(ADMIN_TTL)

    def session_ttl(self, ttl: float) -> float:
        """The TTL a lease asked for `ttl` seconds gets: the session timeout the server grants."""
        return self._session(ttl).ttl

    def _check_acl(self, session: Session) -> None:
        """Once per session: may this identity write the root, the fence base's parent?

        Refused (LockError naming the fix) if the root is another identity's; a warning if
        it is world-writable although we authenticate (made before auth was set up)."""
        if session.sid is not None and session.sid in self._acl_checked:
            return
        c = session.client
        try:
            acls, _ = self._call(session, "setup", None, lambda: c.get_acls_async(self.root))
        except NoNodeError:
            return  # made by _setup, with our ACL
        if session.sid is not None:
            self._acl_checked.add(session.sid)
        if _writable(acls, "world", "anyone"):
            if self._identity is not None:
                log.warning(
                    "ZooKeeper nodes under %s are writable by anyone (made before the lock "
                    "URL named a user): remove them (zkCli deleteall %s, with no job running) "
                    "so they are made again with this user's ACL", self.root, self.root,
                )  # fmt: skip
            return
        if self._identity is None or not _writable(acls, "digest", self._identity):
            problem, fix = self._not_ours("writes")
            raise LockError(f"{problem}; fix: {fix}")

    def _ping(self) -> str:
        # A read, not server_time (which writes a node): a probe changes nothing.
        session = self._any_session()
        self._call(session, "health", None, lambda: session.client.exists_async("/"))
        return "zookeeper answered"

    def server_time(self) -> float:
        """Now on the server's clock: the mtime of a write to `<prefix>/clock`."""
        session = self._any_session()
        path = f"{self.root}/clock"
        for _ in range(3):
            before = time.time()
            try:
                stat = self._call(session, "server time", None,
                                  lambda: session.client.set_async(path, b""))  # fmt: skip
            except NoNodeError:
                self._setup(session)
                self._create_quietly(session, path, b"")
                continue
            self._note_clock(stat.mtime, before, time.time())
            return float(stat.mtime) / 1000
        raise BackendUnavailable("zookeeper server time: the clock node keeps vanishing")

    def _create_quietly(self, session: Session, path: str, data: bytes) -> None:
        with contextlib.suppress(NodeExistsError):
            self._call(session, "setup", None, lambda: session.client.create_async(path, data))

    def _setup(self, session: Session) -> None:
        """Make the prefix's nodes (and the chroot) where missing, and the fence base once."""
        c = session.client
        for part in ("locks", "keys"):
            path = f"{self.root}/{part}"
            self._call(session, "setup", None, lambda p=path: c.ensure_path_async(p))  # type: ignore[misc]
        # The 256 buckets of key nodes in one multi (then a new key is one multi): racing
        # processes send one request each, and all but the first find them made. A bucket
        # missing later is made when a grant needs it.
        self._multi(session, "setup", None,
                    [("create", f"{self.root}/keys/{i:02x}", b"") for i in range(256)])  # fmt: skip
        base = f"{self.root}/fence-base"
        try:
            _, stat = self._call(
                session, "setup", None, lambda: c.create_async(base, b"", include_data=True)
            )
        except NodeExistsError:
            pass
        else:  # the data says in µs what the ctime says in ms, for a human reading it
            note = str(stat.ctime * 1000).encode()
            with contextlib.suppress(BadVersionError, NoNodeError):
                self._call(session, "setup", None, lambda: c.set_async(base, note, 0))
        self._load_base(session)

    def _load_base(self, session: Session) -> int:
        """Read the fence base (µs) once per session: a new session may meet new data."""
        self._check_acl(session)
        c = session.client
        try:
            _, stat = self._call(
                session, "fence base", None, lambda: c.get_async(f"{self.root}/fence-base")
            )
        except NoNodeError:
            self._setup(session)
            assert self._base_us is not None
            return self._base_us
        base = int(stat.ctime) * 1000
        if self._base_us is not None and base != self._base_us:
            self._old_floor = max(self._old_floor, self.fence_floor)
            self.fence_floor = 0
            log.warning(
                "ZooKeeper's fence base changed (its data was lost or replaced): fences "
                "start again above %d; sessions of the old data are dropped", base,
            )  # fmt: skip
            self._drop_other_sessions(session)
        self._base_us = base
        if session.sid is not None:
            self._base_seen.add(session.sid)
        return base

    def _fence(self, session: Session, czxid: int) -> int:
        if self._base_us is None or session.sid not in self._base_seen:
            self._load_base(session)
        assert self._base_us is not None
        return self._base_us + czxid

    def _drop_other_sessions(self, keep: Session) -> None:
        for session in list(self._sessions.values()):
            if session is not keep:
                session.retire()  # its grants are lost (the reaper says so to their leases)
        self._wake.set()
