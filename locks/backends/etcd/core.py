"""What every part of the etcd backend stands on: its requests, its leases and its fence base."""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jobfence.locks.backend import LockBackend
from jobfence.locks.backends.etcd.errors import (
    GatewayError,
    OutcomeUnknown,
    SetupError,
    Unreachable,
    setup_problem,
)
from jobfence.locks.backends.etcd.gateway import Gateway
from jobfence.locks.backends.etcd.ops import absent, kv_of, lease_gone, put_op, range_op, text_of
from jobfence.locks.backends.etcd.target import TLS, USERINFO_FIX
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LockError

#: Lease TTLs are whole seconds on etcd; shorter asks are raised to this (etcd's own floor
#: is 1.5 election timeouts, 2 s with its defaults).
MIN_TTL = 2
#: A grant attaches the key to the process's lease for that TTL; if that lease was last
#: confirmed more than this fraction of its TTL ago, it is kept alive first (one more round
#: trip), so a new grant always starts with most of its TTL ahead.
REFRESH_FRACTION = 0.4


@dataclass
class _Session:
    """One etcd lease: `ttl` whole seconds, confirmed alive at `since` (monotonic, send time)."""

    id: str
    ttl: int
    since: float


def whole_seconds(ttl_ms: int) -> int:
    """A TTL in ms as etcd can grant it: whole seconds, rounded up, at least MIN_TTL."""
    return max(MIN_TTL, math.ceil(ttl_ms / 1000))


class EtcdCore(LockBackend):
    """The etcd backend's requests (errors made BackendUnavailable or SetupError), this
    process's leases (one per TTL, and timed ones for records) and the deployment's fence
    base; EtcdBackend mixes in the lock, record, inspection and check parts built on it."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        clock: Clock = SYSTEM_CLOCK,
        tls: TLS | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__(clock=clock)
        if not prefix or any(c in prefix for c in "\n\0"):
            raise LockError(f"etcd key prefix must be a non-empty line of text, got {prefix!r}")
        if (user is None) != (password is None):
            raise LockError("etcd authentication needs both a user and a password; fix: use "
                            + USERINFO_FIX)  # fmt: skip
        self.prefix = prefix
        self.endpoints = list(endpoints)
        self.socket_timeout = socket_timeout
        self.tls = tls
        self.user = user
        self.gateway = Gateway(
            self.endpoints,
            timeout=socket_timeout,
            tls=tls.context() if tls is not None else None,
            credentials=(user, password) if user is not None and password is not None else None,
        )
        self.fence_floor = 0  # the highest fence this client was granted
        self._base: tuple[int, str] | None = None  # (fence base, its stored text)
        self._base_key = f"{prefix}/fence-base"
        self._mutex = threading.Lock()
        self._reset_process_state()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (b := ref()) and b._reset_process_state())  # type: ignore[func-returns-value]

    def _reset_process_state(self) -> None:
        """Leases belong to the process that took them: a forked child starts without any."""
        self._mutex = threading.Lock()
        self._sessions: dict[int, _Session] = {}  # lock leases, by TTL
        self._timed: dict[int, _Session] = {}  # record and marker leases, by minimum life
        self._granted: dict[str, tuple[float, int]] = {}  # owner -> (since, ttl) of a grant
        self._suspects: dict[tuple[str, str], None] = {}  # grants whose fate is unknown
        self._local = threading.local()

    # -- keys -------------------------------------------------------------------------
    def _key(self, kind: str, key: str) -> str:
        return f"{self.prefix}/{kind}/{key}"

    @property
    def requests(self) -> int:
        """Requests sent to etcd so far (each one round trip)."""
        return self.gateway.requests

    # -- calls ------------------------------------------------------------------------
    def _call(
        self,
        what: str,
        key: str | None,
        path: str,
        body: dict[str, Any],
        *,
        idempotent: bool = False,
        suspect: tuple[str, str] | None = None,
    ) -> Any:
        """One request; transport and server errors become BackendUnavailable (the server's
        answer, a GatewayError, is its `cause`), a TLS or login set-up that cannot work
        SetupError (a LockError naming the fix).

        `suspect` (key, owner): if the request may have been applied without an answer, a
        later call deletes that grant (it would otherwise live as long as the lease).
        """
        try:
            return self.gateway.call(path, body, idempotent=idempotent)
        except (Unreachable, GatewayError) as exc:
            self._refuse_setup(exc, key)
            if isinstance(exc, Unreachable):
                raise BackendUnavailable(f"etcd {what} failed", key=key, cause=exc) from exc
            if suspect is not None and not exc.surely_not_applied:
                self._suspects[suspect] = None
            raise BackendUnavailable(
                f"etcd {what} failed on {self.gateway.endpoint}", key=key, cause=exc
            ) from exc
        except OutcomeUnknown as exc:
            if suspect is not None:
                self._suspects[suspect] = None
            raise BackendUnavailable(
                f"etcd {what} failed on {self.gateway.endpoint}", key=key, cause=exc
            ) from exc

    def _refuse_setup(self, exc: BaseException, key: str | None) -> None:
        """Raise SetupError if `exc` is a TLS or login set-up no wait will mend."""
        found = self.setup_problem(exc)
        if found is not None:
            raise SetupError(*found, key=key, cause=exc) from exc

    def setup_problem(self, exc: BaseException) -> tuple[str, str] | None:
        """(problem, fix) if `exc` says the TLS or login set-up cannot work, else None."""
        return setup_problem(exc, self.gateway.endpoint, self.user, self.prefix)

    def _txn(
        self,
        what: str,
        key: str | None,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
        *,
        suspect: tuple[str, str] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"compare": compare, "success": success}
        if failure:
            body["failure"] = failure
        reply: dict[str, Any] = self._call(what, key, "/v3/kv/txn", body, suspect=suspect)
        return reply

    def _read(self, what: str, key: str | None, ops: list[dict[str, Any]]) -> list[Any]:
        """A read-only txn (safe to repeat on another endpoint); its responses."""
        reply = self._call(what, key, "/v3/kv/txn", {"success": ops}, idempotent=True)
        responses: list[Any] = reply.get("responses", [])
        return responses

    # -- leases -------------------------------------------------------------------------
    def _grant(self, ttl: int, key: str | None) -> _Session:
        sent = self.clock.monotonic()
        reply = self._call("lease grant", key, "/v3/lease/grant", {"TTL": ttl})
        granted = int(reply.get("TTL", 0))  # etcd may raise a TTL below its floor
        if not reply.get("ID") or granted <= 0:
            raise BackendUnavailable(f"etcd lease grant refused: {reply.get('error', reply)}",
                                     key=key)  # fmt: skip
        return _Session(id=str(reply["ID"]), ttl=granted, since=sent)

    def _keepalive(self, lease_id: str, key: str | None) -> int:
        """Renew `lease_id`; its TTL, or 0 if etcd no longer has it (the lease is lost)."""
        reply = self._call(
            "lease keepalive", key, "/v3/lease/keepalive", {"ID": lease_id}, idempotent=True
        )
        # A reply without TTL (proto3 leaves out zeros) means the lease has expired.
        return int(reply.get("result", {}).get("TTL", 0))

    def _session(self, ttl: int, key: str | None, *, max_age: float | None = None) -> _Session:
        """This process's lease for `ttl`, confirmed alive within `max_age` seconds
        (default REFRESH_FRACTION of the TTL); granted anew if it was lost."""
        with self._mutex:
            current = self._sessions.get(ttl)
            now = self.clock.monotonic()
            limit = REFRESH_FRACTION * ttl if max_age is None else max_age
            if current is not None and now - current.since <= limit:
                return current
            if current is not None:
                sent = self.clock.monotonic()
                if self._keepalive(current.id, key) > 0:
                    current.since = max(current.since, sent)
                    return current
                del self._sessions[ttl]
            session = self._sessions[ttl] = self._grant(ttl, key)
            return session

    def _drop_session(self, lease_id: str) -> None:
        with self._mutex:
            for ttl, session in list(self._sessions.items()):
                if session.id == lease_id:
                    del self._sessions[ttl]
            for life, session in list(self._timed.items()):
                if session.id == lease_id:
                    del self._timed[life]

    def _confirmed(self, lease_id: str, sent: float) -> None:
        with self._mutex:
            for session in self._sessions.values():
                if session.id == lease_id and sent > session.since:
                    session.since = sent

    def _timed_lease(self, seconds: float, key: str | None) -> str:
        """A lease that ends at least `seconds` from now and not much later: shared by the
        records and markers written within a slack of a few percent of its life."""
        life = max(MIN_TTL, math.ceil(seconds))
        slack = max(1, min(60, math.ceil(life * 0.05)))
        with self._mutex:
            current = self._timed.get(life)
            if current is not None and self.clock.monotonic() - current.since <= (
                current.ttl - life
            ):
                return current.id
            session = self._timed[life] = self._grant(life + slack, key)
            return session.id

    def _on_timed_lease(
        self, seconds: float, key: str, send: Callable[[str], dict[str, Any]]
    ) -> dict[str, Any]:
        """`send(lease)` with a lease ending at least `seconds` from now; once more with a
        new lease if etcd no longer has the cached one (a new cluster)."""
        for attempt in (0, 1):
            lease = self._timed_lease(seconds, key)
            try:
                return send(lease)
            except BackendUnavailable as exc:
                if attempt == 0 and lease_gone(exc):
                    self._drop_session(lease)
                    continue
                raise
        raise AssertionError("unreachable")

    # -- fence base ---------------------------------------------------------------------
    def _fence_base(self, key: str | None) -> tuple[int, str]:
        """(base, its stored text): read once, created the first time a deployment needs it."""
        base = self._base
        if base is not None:
            return base
        found = kv_of(self._read("fence base", key, [range_op(self._base_key)])[0])
        if found is None:
            # Above this client's clock, the server's (Date header, whole seconds) and every
            # fence this client has seen; whoever creates it first wins.
            proposed = str(max(int(time.time() * 1e6), self.gateway.date_us(),
                               self.fence_floor + 1))  # fmt: skip
            reply = self._txn(
                "fence base",
                key,
                [absent(self._base_key)],
                [put_op(self._base_key, proposed)],
                [range_op(self._base_key)],
            )
            text = proposed if reply.get("succeeded") else text_of(kv_of(reply["responses"][0]))
        else:
            text = text_of(found)
        try:
            base = (int(text), text)
        except ValueError as exc:
            raise BackendUnavailable(
                f"etcd key {self._base_key!r} does not hold a number; delete it only together "
                "with every lock key (a new base is then taken from the clock)",
                key=key,
            ) from exc
        self._base = base
        return base
