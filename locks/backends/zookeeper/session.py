"""One KazooClient and its session: the TTL the server granted, its state, why it failed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import Auth, Connect
from kazoo.protocol.states import KazooState
from kazoo.retry import KazooRetry

from jobfence.locks.backends.zookeeper.tls import TLSRefused, tls_problem
from jobfence.locks.backends.zookeeper.url import TLS_OPTIONS
from jobfence.locks.clock import Clock
from jobfence.locks.errors import BackendUnavailable

log = logging.getLogger(__package__)  # one logger for the package's modules

RECONNECT_CAP = 1.0  # seconds between reconnection attempts at most (kazoo's default: 1 h)


class _HideAuth(logging.Filter):
    """kazoo logs every request it sends at DEBUG, the digest login too ("Auth(... auth=
    'user:password')"): the password is replaced before any handler sees the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, Auth) for a in args):
            record.args = tuple(
                a._replace(auth=f"{a.auth.partition(':')[0]}:<hidden>") if isinstance(a, Auth)
                else a
                for a in args
            )  # fmt: skip
        return True


# Our clients' logger: kazoo.client's child, so its handlers and levels apply.
_kazoo_log = logging.getLogger("kazoo.client.jobfence")
_kazoo_log.addFilter(_HideAuth())


class Session:
    """One KazooClient and its session, for one TTL; the TTL is what the server granted."""

    def __init__(
        self,
        hosts: str,
        requested_ms: int,
        socket_timeout: float,
        clock: Clock,
        options: dict[str, Any],
    ) -> None:
        self.clock = clock
        self.negotiated_ms = requested_ms
        self.client = KazooClient(
            hosts=hosts,
            **options,
            logger=_kazoo_log,
            timeout=requested_ms / 1000,
            connection_retry=KazooRetry(
                max_tries=-1, delay=0.05, backoff=2, max_jitter=0.3, max_delay=RECONNECT_CAP
            ),
        )
        self.socket_timeout = socket_timeout
        self.down_since: float | None = None  # monotonic; None while connected
        self.dead = False
        self.on_change: Callable[[], None] = lambda: None
        self.tls = {k: v for k, v in options.items() if k in TLS_OPTIONS}
        # The last failed connection attempt (host:port, error), cleared once connected.
        self.last_failure: tuple[str, BaseException] | None = None
        self._refused: set[str] = set()  # members that refused the TLS session
        self._settled = threading.Event()  # set when connected, or refused by every member
        self._hook_negotiation()
        self._hook_attempts()
        self.client.add_listener(self._state_changed)

    def _hook_negotiation(self) -> None:
        """Learn the session timeout the server granted: kazoo reads it from the connect
        answer but keeps only the one asked for."""
        connection: Any = getattr(self.client, "_connection", None)
        invoke = getattr(connection, "_invoke", None)
        if invoke is None:  # another kazoo: leases then report the TTL asked for
            return

        def spy(timeout: float, request: Any, xid: int | None = None) -> Any:
            answer = invoke(timeout, request, xid)
            if isinstance(request, Connect) and isinstance(answer, tuple) and answer:
                granted = getattr(answer[0], "time_out", 0)
                if granted > 0:
                    self.negotiated_ms = int(granted)
            return answer

        connection._invoke = spy

    def _hook_attempts(self) -> None:
        """Keep why each connection attempt failed: kazoo logs it, retries, and at the end
        says only "Connection time-out". Once every member has refused the TLS session,
        `start` stops waiting (a refusal does not mend by retrying)."""
        connection: Any = getattr(self.client, "_connection", None)
        attempt = getattr(connection, "_connect", None)
        if attempt is None:  # another kazoo: the message then lacks the cause
            return
        members = {f"{h}:{p}" for h, p in (self.client.hosts or ())}

        def spy(host: str, hostip: str, port: int) -> Any:
            try:
                return attempt(host, hostip, port)
            except Exception as exc:
                where = f"{host}:{port}"
                self.last_failure = (where, exc)
                if self.tls and tls_problem(exc, where, self.tls) is not None:
                    self._refused.add(where)
                    if self._refused >= members:
                        self._settled.set()  # wakes start(), which then sees no connection
                raise

        connection._connect = spy

    def failure(self) -> tuple[str, str] | None:
        """(problem, fix) of the last failed connection attempt if it was a TLS refusal."""
        if self.last_failure is None or not self.tls:
            return None
        return tls_problem(self.last_failure[1], self.last_failure[0], self.tls)

    def why_down(self) -> str:
        """A short account of the last failed connection attempt, for an error message."""
        found = self.failure()
        if found is not None:
            return f"{found[0]}; fix: {found[1]}"
        if self.last_failure is None:
            return "no answer"
        where, exc = self.last_failure
        text = str(exc) or type(exc).__name__
        if not self.tls and "connection broken" in text:
            # A TLS port (secureClientPort) closes on a plain Connect request at once.
            text += (" (if that port is ZooKeeper's secureClientPort, the lock URL needs "
                     "use_ssl=true&ca=/path/ca.pem)")  # fmt: skip
        return f"{where}: {text}"

    @property
    def ttl(self) -> float:
        return self.negotiated_ms / 1000

    @property
    def connected(self) -> bool:
        # kazoo's own flag: set before the state listeners hear of the connection
        return not self.dead and bool(self.client.connected)

    def wait_connected(self, timeout: float) -> bool:
        """Wait up to `timeout` for a (re)connection: an election or a dropped connection
        costs a short wait, not an error. Requests go out only once connected, so none is
        queued by kazoo to leave later, after its caller gave up."""
        if self.connected:
            return True
        if self.dead:
            return False
        self.client._live.wait(timeout)  # kazoo's "connected" event
        return self.connected

    def _state_changed(self, state: str) -> None:
        # kazoo's connection thread: record and hand over, never block here.
        # (LOST: the session ended, and its ephemeral nodes with it; `sid` says so.)
        if state == KazooState.CONNECTED:
            self.down_since = None
            self.last_failure = None
            self._settled.set()
        elif self.down_since is None:  # SUSPENDED or LOST
            self.down_since = self.clock.monotonic()
        self.on_change()

    @property
    def sid(self) -> int | None:
        """The session's id, None between sessions; a new session has a new id. (kazoo sets
        it before it reports the connection, and clears it when the session ends.)"""
        return None if self.dead else self.client._session_id  # type: ignore[no-any-return]

    def start(self) -> None:
        """Connect, or raise TLSRefused (a TLS set-up to fix) or BackendUnavailable."""
        try:
            # kazoo's start(), but it may stop waiting early: when every member refused TLS.
            self.client.start_async()
            self._settled.wait(self.socket_timeout)
            if not self.client.connected:
                self.client.stop()
                self.client.close()
                raise KazooTimeoutError("Connection time-out")
        except (KazooException, KazooTimeoutError) as exc:
            self.dead = True
            found = self.failure()
            if found is not None:
                raise TLSRefused(*found, cause=exc) from exc
            raise BackendUnavailable(
                f"cannot connect to ZooKeeper within {self.socket_timeout:g}s "
                f"({self.why_down()})",
                cause=exc,
            ) from exc

    def retire(self) -> None:
        """Give the session up: no more requests on it; its client stops in the background."""
        if not self.dead:
            self.dead = True
            threading.Thread(target=self.stop, name="jobfence-zookeeper-stop", daemon=True).start()

    def stop(self) -> None:
        """End the session (its ephemeral nodes go at once if the server is reachable)."""
        self.dead = True
        try:
            self.client.stop()
            self.client.close()
        except Exception:  # stopping a broken client must not raise on the caller
            log.debug("stopping a ZooKeeper client failed", exc_info=True)
