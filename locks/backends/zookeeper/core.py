"""ZooKeeperBackend's core: its options and state, the fork reset, one request, one multi."""

from __future__ import annotations

import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kazoo.exceptions import ConnectionLoss as KazooConnectionLoss
from kazoo.exceptions import (
    KazooException,
    NoAuthError,
    NoNodeError,
    RolledBackError,
    RuntimeInconsistency,
    ZookeeperError,
)
from kazoo.exceptions import OperationTimeoutError as KazooOperationTimeout
from kazoo.exceptions import SessionExpiredError as KazooSessionExpired
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.security import make_digest_acl, make_digest_acl_credential

from jobfence.locks.backend import LockBackend, Security
from jobfence.locks.backends.common import FENCE_RETENTION
from jobfence.locks.backends.zookeeper.nodes import Grant, Paths
from jobfence.locks.backends.zookeeper.session import Session
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LockError

PRUNE_INTERVAL = 600.0


# What says "the request's outcome is unknown" (or it never went out), as opposed to a
# server's answer (NoNode, NodeExists, BadVersion...): the call raises BackendUnavailable.
TRANSPORT = (
    KazooConnectionLoss,
    KazooSessionExpired,  # ConnectionClosedError too
    KazooOperationTimeout,
    KazooTimeoutError,
)

# Clients inherited through fork: never stopped or closed in the child (a Close request on
# the parent's socket would end the parent's session), never collected either.
_inherited: list[Any] = []


def multi_failure(results: Sequence[Any]) -> tuple[int, Exception] | None:
    """The failed operation of a multi (index, error), or None if it committed."""
    for i, r in enumerate(results):
        if isinstance(r, Exception) and not isinstance(r, RolledBackError | RuntimeInconsistency):
            return i, r
    return None


def _check_prefix(prefix: str) -> None:
    """Refuse a key prefix that cannot name a node under the chroot."""
    if not prefix or "/" in prefix or prefix in (".", "..") or prefix == "zookeeper":
        raise LockError(
            f"key prefix {prefix!r} cannot be a ZooKeeper node name; "
            "set JOBFENCE_KEY_PREFIX to a name without '/'"
        )


def _client_options(tls: dict[str, Any], auth: tuple[str, str] | None) -> dict[str, Any]:
    """KazooClient's TLS and digest arguments. Digest auth: the session authenticates as
    user:password, and every node made here (kazoo's default_acl covers create, ensure_path
    and multi) is that identity's alone."""
    options = dict(tls)
    if "certfile" in tls and "keyfile" not in tls:
        # kazoo loads a client certificate only given both; one PEM may hold the two.
        options["keyfile"] = tls["certfile"]
    if auth:
        options["auth_data"] = [("digest", f"{auth[0]}:{auth[1]}")]
        options["default_acl"] = [make_digest_acl(*auth, all=True)]
    return options


class Core(LockBackend):
    """ZooKeeperBackend's state and its requests, which its other parts build on."""

    def __init__(
        self,
        hosts: str,
        *,
        chroot: str = "",
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = FENCE_RETENTION,
        prune_interval: float = PRUNE_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
        auth: tuple[str, str] | None = None,
        tls: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(clock=clock)
        _check_prefix(prefix)
        self.hosts = hosts
        self.root = f"{chroot}/{prefix}"
        self.user = auth[0] if auth else None
        self.tls_options = dict(tls or {})
        self._identity = make_digest_acl_credential(*auth) if auth else None  # as ACLs name it
        self._client_options = _client_options(self.tls_options, auth)
        self._acl_checked: set[int] = set()  # sessions (ids) that checked the root's ACL
        self.socket_timeout = socket_timeout
        self.fence_retention = fence_retention
        self.prune_interval = prune_interval
        self.requests = 0  # requests sent (one round trip each), for tests and benchmarks
        self.fence_floor = 0  # the highest fence granted here under the current base
        self._old_floor = 0  # ... and under earlier bases (data the server has lost)
        self._base_us: int | None = None
        self._base_seen: set[int] = set()  # the sessions (ids) that read the base
        self._skew = 0.0  # server wall clock minus ours, seconds (from our writes' mtime)
        self._known: set[str] = set()
        self._warned_ttl: set[int] = set()
        self._next_prune = clock.monotonic() + prune_interval * random.uniform(0.5, 1.0)
        self._max_block = max(0.01, 0.8 * socket_timeout)
        self._reset()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (b := ref()) and b._reset(forked=True))  # type: ignore[func-returns-value]

    def _reset(self, *, forked: bool = False) -> None:
        if forked:
            _inherited.extend(s.client for s in self._sessions.values())
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._connecting = threading.Lock()
        self._sessions: dict[int, Session] = {}  # by requested TTL (ms)
        self._grants: dict[tuple[str, str], Grant] = {}
        # Nodes made for no lease, to delete: (lock path, owner digest).
        self._orphans: list[tuple[str, str]] = []
        self._tls = threading.local()
        self._reaper: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._base_seen = set()

    def _paths(self, name: str) -> Paths:
        bucket = f"{self.root}/keys/{name[:2]}"
        return Paths(lock=f"{self.root}/locks/{name}", bucket=bucket, key=f"{bucket}/{name}")

    def _call(self, session: Session, what: str, key: str | None, start: Callable[[], Any]) -> Any:
        """One request, one round trip. A server's answer (NoNode, ...) is raised as kazoo's
        error; no answer (not connected, timeout, connection lost) as BackendUnavailable."""
        if not session.wait_connected(self.socket_timeout):
            raise BackendUnavailable(
                f"zookeeper {what}: not connected ({session.why_down()})", key=key
            )
        self.requests += 1
        try:
            result = start().get(timeout=self.socket_timeout)
        except TRANSPORT as exc:
            raise BackendUnavailable(f"zookeeper {what} failed", key=key, cause=exc) from exc
        except NoAuthError as exc:
            problem, fix = self._not_ours(what)
            raise LockError(f"{problem}; fix: {fix}", key=key, cause=exc) from exc
        except ZookeeperError:
            raise  # the server's answer: NoNode, NodeExists, BadVersion...
        except KazooException as exc:
            raise BackendUnavailable(f"zookeeper {what} failed", key=key, cause=exc) from exc
        return result

    def _multi(
        self, session: Session, what: str, key: str | None, ops: Sequence[tuple[Any, ...]]
    ) -> list[Any]:
        """One multi of (op, path, ...) tuples: all applied, or none (results say which failed)."""

        def start() -> Any:
            tx = session.client.transaction()
            for op, *args in ops:
                if op == "create":
                    tx.create(args[0], args[1])
                elif op == "ephemeral":
                    tx.create(args[0], args[1], ephemeral=True)
                elif op == "set":
                    tx.set_data(args[0], args[1], *args[2:])
                elif op == "check":
                    tx.check(args[0], args[1])
                else:
                    tx.delete(*args)
            return tx.commit_async()

        return list(self._call(session, what, key, start))

    def _read(self, session: Session, what: str, key: str | None, path: str) -> Any:
        try:
            return self._call(session, what, key, lambda: session.client.get_async(path))
        except NoNodeError:
            return None

    def security(self) -> Security:
        """TLS as the URL's options asked, auth: a digest identity in its user-info."""
        tls = bool(self.tls_options)
        return Security(
            tls=tls,
            verified=tls and bool(self.tls_options.get("verify_certs")),
            hostname_checked=tls and bool(self.tls_options.get("check_hostname")),
            auth=self._identity is not None,
        )

    def _not_ours(self, what: str) -> tuple[str, str]:
        """(problem, fix) when the server refuses us a node under the root (NoAuth)."""
        if self.user is None:
            return (
                f"ZooKeeper refused {what} under {self.root} (NoAuth): its nodes are "
                "protected by an ACL and the lock URL names no user",
                "put the digest user and password that made them in the lock URL: "
                "zookeeper://user:password@host:2181/chroot (percent-encoded)",
            )
        return (
            f"ZooKeeper refused {what} under {self.root} to user {self.user!r} (NoAuth): "
            "its nodes belong to another identity (or the password is wrong)",
            "put the user and password that made them in the lock URL, percent-encoded; or "
            "use a chroot or JOBFENCE_KEY_PREFIX of this identity's own",
        )

    def _note_clock(self, mtime_ms: int, before: float, after: float) -> None:
        """Our estimate of the server's wall clock, from a write's mtime (inspect, expiry)."""
        self._skew = mtime_ms / 1000 - (before + after) / 2

    def server_now(self) -> float:
        """The server's wall clock as estimated from our latest write (no round trip)."""
        return time.time() + self._skew
