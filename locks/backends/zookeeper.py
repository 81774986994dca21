"""The ZooKeeper lock backend: an ephemeral node per lock, the session its lease, czxid fences."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import random
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
    RuntimeInconsistency,
    ZookeeperError,
)
from kazoo.exceptions import ConnectionLoss as KazooConnectionLoss
from kazoo.exceptions import OperationTimeoutError as KazooOperationTimeout
from kazoo.exceptions import SessionExpiredError as KazooSessionExpired
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import Auth, Connect
from kazoo.protocol.states import KazooState
from kazoo.retry import KazooRetry
from kazoo.security import (
    ACL,
    Permissions,
    make_digest_acl,
    make_digest_acl_credential,
)

from jobfence.config.findings import Finding, LockTarget
from jobfence.locks import registry
from jobfence.locks.backend import (
    BeginResult,
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    Security,
    default_meta,
    validate_key,
    validate_ttl,
)
from jobfence.locks.backends.common import flag_value, server_findings
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LeaseLost, LockError, NotOwner
from jobfence.locks.lease import DRIFT_FLOOR, DRIFT_FRACTION, Lease, OwnerMeta, new_owner_token

log = logging.getLogger(__name__)

SCHEMES = registry.entry("zookeeper").schemes  # the registry is the one list
DEFAULT_PORT = 2181
ADMIN_TTL = 10.0  # the session of a process that holds no lease (CLI, admin calls)
ATTEMPTS = 6  # a begin that keeps meeting a release, a new key node or a cleared record
MAX_RECORD_BYTES = 512 * 1024  # ZooKeeper refuses packets over jute.maxbuffer (1 MB)
KNOWN_KEYS = 10_000  # key nodes this process knows exist (a cache, emptied when full)
PRUNE_INTERVAL = 600.0
RECONNECT_CAP = 1.0  # seconds between reconnection attempts at most (kazoo's default: 1 h)
STALE_MARGIN = 0.5  # a node unextended this long past its TTL (or half the TTL) is no lease's

# What says "the request's outcome is unknown" (or it never went out), as opposed to a
# server's answer (NoNode, NodeExists, BadVersion...): the call raises BackendUnavailable.
_TRANSPORT = (
    KazooConnectionLoss,
    KazooSessionExpired,  # ConnectionClosedError too
    KazooOperationTimeout,
    KazooTimeoutError,
)

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

# Clients inherited through fork: never stopped or closed in the child (a Close request on
# the parent's socket would end the parent's session), never collected either.
_inherited: list[Any] = []


def node_name(key: str) -> str:
    """The node name of `key`: SHA-256 hex, 128 bits (keys run to 512 characters, and any
    character but '/' and a few control ones would do in a name, so the key is hashed)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def owner_digest(owner: str) -> str:
    """What the lock node keeps of the owner token: enough to find our own node after a
    grant whose answer was lost, never the token itself."""
    return hashlib.sha256(b"jobfence-owner\n" + owner.encode()).hexdigest()[:32]


TLS_OPTIONS = ("use_ssl", "ca", "certfile", "keyfile", "verify_certs", "check_hostname")


@dataclass(frozen=True)
class Target:
    """What a zookeeper:// URL names: the ensemble, the chroot, the digest identity, TLS."""

    hosts: str  # kazoo's host list 'h1:p1,h2:p2'
    chroot: str  # '' or '/a/b'
    auth: tuple[str, str] | None = field(default=None, repr=False)  # (user, password)
    tls: dict[str, Any] = field(default_factory=dict)  # KazooClient's TLS arguments

    @property
    def user(self) -> str | None:
        return self.auth[0] if self.auth else None


def parse_url(url: str) -> tuple[str, str]:
    """(kazoo host list 'h1:p1,h2:p2', chroot '' or '/a/b') of a zookeeper:// URL."""
    target = parse_target(url)
    return target.hosts, target.chroot


def parse_target(url: str) -> Target:
    """`zookeeper://[user:password@]host:port[,host:port...][/chroot][?TLS options]`.

    The user-info (percent-encoded) is a digest identity: the client authenticates with it
    and every node jobfence creates gets an ACL giving that identity alone any access. TLS
    options are KazooClient's: any of `use_ssl=true`, `ca`, `certfile`, `keyfile` turns TLS on,
    which verifies the certificate and the host name unless `verify_certs=false` /
    `check_hostname=false` says otherwise. Errors never quote the password."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in SCHEMES:
        raise ValueError(f"not a ZooKeeper URL: {parts.scheme}://")
    userinfo, at, netloc = parts.netloc.rpartition("@")
    auth = None
    if at:
        user, colon, password = userinfo.partition(":")
        user, password = unquote(user), unquote(password)
        if not user or not colon or not password:
            raise ValueError(
                "zookeeper:// user-info needs a user and a password for digest authentication: "
                "zookeeper://user:password@host:2181/chroot (percent-encoded)"
            )
        if ":" in user:
            raise ValueError(
                "the zookeeper:// user name holds a ':', which digest authentication cannot "
                "carry; choose a user name without one"
            )
        auth = (user, password)
    if parts.fragment:
        raise ValueError("zookeeper:// URLs take no fragment")
    hosts = []
    for item in netloc.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or "]" in port:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"zookeeper:// host {item!r} is not host:port")
        hosts.append(f"{host}:{port}")
    chroot = parts.path.rstrip("/")
    if chroot and any(p in ("", ".", "..") for p in chroot[1:].split("/")):
        raise ValueError(f"zookeeper:// chroot {parts.path!r} is not a valid node path")
    return Target(",".join(hosts), chroot, auth, _tls_options(parts.query))


def _flag(name: str, value: str) -> bool:
    if (flag := flag_value(value)) is not None:
        return flag
    raise ValueError(f"zookeeper:// option {name}={value!r} is not true or false")


def _tls_options(query: str) -> dict[str, Any]:
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in TLS_OPTIONS:
            raise ValueError(
                f"unknown option {name!r} in the zookeeper:// URL; known: {', '.join(TLS_OPTIONS)}"
            )
        options[name] = value
    files: dict[str, Any] = {n: options[n] for n in ("ca", "certfile", "keyfile") if n in options}
    for name, path in files.items():
        if not path:
            raise ValueError(f"zookeeper:// option {name}= is empty: give a PEM file path")
    use_ssl = _flag("use_ssl", options["use_ssl"]) if "use_ssl" in options else None
    if use_ssl is False:
        if len(options) > 1:
            raise ValueError(
                "the zookeeper:// URL gives use_ssl=false with other TLS options; drop one"
            )
        return {}
    if not use_ssl and not files:
        if options:
            raise ValueError(
                "the zookeeper:// URL gives verify_certs/check_hostname without TLS: add "
                "use_ssl=true (and ca=/path/ca.pem)"
            )
        return {}
    if "keyfile" in files and "certfile" not in files:
        raise ValueError("the zookeeper:// URL gives keyfile without certfile: add certfile=")
    verify = _flag("verify_certs", options.get("verify_certs", "true"))
    hostname = _flag("check_hostname", options.get("check_hostname", str(verify)))
    if hostname and not verify:
        raise ValueError(
            "the zookeeper:// URL gives check_hostname=true with verify_certs=false: a host "
            "name is checked only on a verified certificate; drop verify_certs=false"
        )
    return {"use_ssl": True, **files, "verify_certs": verify, "check_hostname": hostname}


def _writable(acls: Sequence[ACL], scheme: str, ident: str) -> bool:
    """Does an ACL entry give `scheme:ident` write access?"""
    return any(
        a.id.scheme == scheme and a.id.id == ident and a.perms & Permissions.WRITE for a in acls
    )


class TLSRefused(LockError):
    """The TLS session with ZooKeeper was refused, by the server or by this client: a set-up
    to fix, no outage to wait out. The message says `problem` and `fix`; never a password."""

    def __init__(self, problem: str, fix: str, *, cause: BaseException | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; fix: {fix}", cause=cause)


def tls_problem(exc: BaseException, where: str, tls: dict[str, Any]) -> tuple[str, str] | None:
    """(problem, fix) if `exc`, a failed connection attempt to `where` (host:port), was a TLS
    session refused, else None (a server down, a dropped connection: waited out).

    kazoo retries such an attempt until the connect timeout and then says only "Connection
    time-out"; the cause is the ssl.SSLError behind its ConnectionDropped. Messages name the
    lock URL's option to change (kazoo's spellings) and ZooKeeper's setting on the other side.
    """
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    errors = [e for e in seen if isinstance(e, ssl.SSLError)]
    if not errors:
        return None
    error = errors[-1]
    reason = str(getattr(error, "reason", None) or error).replace("_", " ").lower()
    host = where.rpartition(":")[0].strip("[]")
    if isinstance(error, ssl.SSLCertVerificationError):
        why = error.verify_message or "untrusted"
        if error.verify_code == 62 or "mismatch" in why.lower():  # X509_V_ERR_HOSTNAME_MISMATCH
            return (
                f"ZooKeeper's TLS certificate at {where} is not valid for host {host!r} ({why})",
                "connect by a name or address the certificate holds (the lock URL's host); or, "
                "a downgrade the start-up check warns about, add check_hostname=false to the "
                "lock URL",
            )
        return (
            f"ZooKeeper's TLS certificate at {where} did not verify ({why})",
            "pass the CA that signed it as ca=/path/ca.pem in the lock URL (the CA of the "
            "server's ssl.keyStore certificate)",
        )
    client_cert = (
        "pass a client certificate signed by a CA in the server's ssl.trustStore: "
        "certfile=/path/client.pem&keyfile=/path/client.key in the lock URL"
    )
    if any(m in reason for m in ("bad certificate", "certificate required", "unknown ca",
                                 "handshake failure", "access denied",
                                 "certificate unknown")):  # fmt: skip
        had = "the one given" if tls.get("certfile") else "none was given"
        return (
            f"ZooKeeper at {where} refused the TLS session ({reason}): it requires a client "
            f"certificate it trusts (ssl.clientAuth=need) and {had} is not",
            client_cert,
        )
    if isinstance(error, ssl.SSLEOFError) or "eof" in reason or "wrong version" in reason:
        return (
            f"ZooKeeper at {where} closed the TLS handshake ({reason}): that port may be its "
            "plain clientPort, not its secureClientPort, or it wants a client certificate",
            "put the server's secureClientPort in the lock URL; if it is that port, "
            + client_cert,
        )
    return (
        f"TLS to ZooKeeper at {where} failed ({reason})",
        "check the lock URL's ca=, certfile= and keyfile= (PEM files; the key unencrypted)",
    )


def _failure(results: Sequence[Any]) -> tuple[int, Exception] | None:
    """The failed operation of a multi (index, error), or None if it committed."""
    for i, r in enumerate(results):
        if isinstance(r, Exception) and not isinstance(r, RolledBackError | RuntimeInconsistency):
            return i, r
    return None


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _Session:
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


@dataclass(eq=False)
class _Grant:
    """What this process knows of a lock it was granted (the Lease holds the rest)."""

    key: str
    owner: str = field(repr=False)
    name: str
    session: _Session = field(repr=False)
    sid: int  # the session the lock node belongs to
    version: int  # the key node's version after the grant: the owner check
    fence: int
    data: bytes = field(repr=False)  # the lock node's data, written again on each extension
    deadline: float  # monotonic: the lease's deadline (moved by each extension)
    lease: weakref.ref[Lease] | None = field(default=None, repr=False)
    reaping: bool = False

    def valid(self) -> bool:
        s = self.session
        return s.sid == self.sid


@dataclass(frozen=True)
class _Paths:
    lock: str
    bucket: str
    key: str

    @property
    def job(self) -> str:
        return self.key + "/job"

    @property
    def queued(self) -> str:
        return self.key + "/queued"

    @property
    def deliveries(self) -> str:
        return self.key + "/deliveries"


class ZooKeeperBackend(LockBackend):
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

    def __init__(
        self,
        hosts: str,
        *,
        chroot: str = "",
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = 30 * 24 * 3600.0,
        prune_interval: float = PRUNE_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
        auth: tuple[str, str] | None = None,
        tls: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(clock=clock)
        if not prefix or "/" in prefix or prefix in (".", "..") or prefix == "zookeeper":
            raise LockError(
                f"key prefix {prefix!r} cannot be a ZooKeeper node name; "
                "set JOBFENCE_KEY_PREFIX to a name without '/'"
            )
        self.hosts = hosts
        self.root = f"{chroot}/{prefix}"
        self.user = auth[0] if auth else None
        self.tls_options = dict(tls or {})
        # Digest auth: the session authenticates as user:password, and every node made here
        # (kazoo's default_acl covers create, ensure_path and multi) is that identity's alone.
        self._identity = make_digest_acl_credential(*auth) if auth else None
        self._client_options: dict[str, Any] = dict(self.tls_options)
        if "certfile" in self.tls_options and "keyfile" not in self.tls_options:
            # kazoo loads a client certificate only given both; one PEM may hold the two.
            self._client_options["keyfile"] = self.tls_options["certfile"]
        if auth:
            self._client_options["auth_data"] = [("digest", f"{auth[0]}:{auth[1]}")]
            self._client_options["default_acl"] = [make_digest_acl(*auth, all=True)]
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
        self._sessions: dict[int, _Session] = {}  # by requested TTL (ms)
        self._grants: dict[tuple[str, str], _Grant] = {}
        # Nodes made for no lease, to delete: (lock path, owner digest).
        self._orphans: list[tuple[str, str]] = []
        self._tls = threading.local()
        self._reaper: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._base_seen = set()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = 30 * 24 * 3600.0,
        prune_interval: float = PRUNE_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> ZooKeeperBackend:
        """`zookeeper://[user:password@]host:port[,host:port...][/chroot][?TLS options]`
        (`parse_target`); a missing chroot is created."""
        try:
            target = parse_target(url)
        except ValueError as exc:
            raise LockError(str(exc)) from exc
        return cls(
            target.hosts,
            chroot=target.chroot,
            auth=target.auth,
            tls=target.tls,
            prefix=prefix,
            socket_timeout=socket_timeout,
            fence_retention=fence_retention,
            prune_interval=prune_interval,
            clock=clock,
        )

    # -- paths ----------------------------------------------------------------------------
    def _paths(self, name: str) -> _Paths:
        bucket = f"{self.root}/keys/{name[:2]}"
        return _Paths(lock=f"{self.root}/locks/{name}", bucket=bucket, key=f"{bucket}/{name}")

    # -- sessions -------------------------------------------------------------------------
    def _session(self, ttl: float) -> _Session:
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

    def _connect(self, ms: int) -> _Session:
        for name in ("ca", "certfile", "keyfile"):
            path = self.tls_options.get(name)
            if path is not None and not os.access(path, os.R_OK):
                why = "does not exist" if not os.path.exists(path) else "cannot be read"
                raise TLSRefused(f"the lock URL's {name}={path} {why}",
                                 f"give {name}= a readable PEM file's path")  # fmt: skip
        session = _Session(self.hosts, ms, self.socket_timeout, self.clock, self._client_options)
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

    def _any_session(self) -> _Session:
        """A session for calls that hold nothing (inspect, records, waiting)."""
        if self._pid == os.getpid():
            for session in list(self._sessions.values()):
                if session.connected:
                    return session
        return self._session(ADMIN_TTL)

    def session_ttl(self, ttl: float) -> float:
        """The TTL a lease asked for `ttl` seconds gets: the session timeout the server grants."""
        return self._session(ttl).ttl

    # -- requests -------------------------------------------------------------------------
    def _call(self, session: _Session, what: str, key: str | None, start: Callable[[], Any]) -> Any:
        """One request, one round trip. A server's answer (NoNode, ...) is raised as kazoo's
        error; no answer (not connected, timeout, connection lost) as BackendUnavailable."""
        if not session.wait_connected(self.socket_timeout):
            raise BackendUnavailable(
                f"zookeeper {what}: not connected ({session.why_down()})", key=key
            )
        self.requests += 1
        try:
            result = start().get(timeout=self.socket_timeout)
        except _TRANSPORT as exc:
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
        self, session: _Session, what: str, key: str | None, ops: Sequence[tuple[Any, ...]]
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

    def _check_acl(self, session: _Session) -> None:
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

    def _note_clock(self, mtime_ms: int, before: float, after: float) -> None:
        """Our estimate of the server's wall clock, from a write's mtime (inspect, expiry)."""
        self._skew = mtime_ms / 1000 - (before + after) / 2

    def server_now(self) -> float:
        """The server's wall clock as estimated from our latest write (no round trip)."""
        return time.time() + self._skew

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

    # -- set-up and the fence base ----------------------------------------------------------
    def _create_quietly(self, session: _Session, path: str, data: bytes) -> None:
        with contextlib.suppress(NodeExistsError):
            self._call(session, "setup", None, lambda: session.client.create_async(path, data))

    def _setup(self, session: _Session) -> None:
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

    def _load_base(self, session: _Session) -> int:
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

    def _fence(self, session: _Session, czxid: int) -> int:
        if self._base_us is None or session.sid not in self._base_seen:
            self._load_base(session)
        assert self._base_us is not None
        return self._base_us + czxid

    def _drop_other_sessions(self, keep: _Session) -> None:
        for session in list(self._sessions.values()):
            if session is not keep:
                session.retire()  # its grants are lost (the reaper says so to their leases)
        self._wake.set()

    # -- begin ------------------------------------------------------------------------------
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
        if not isinstance(got, _Grant):
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
        return got.fence if isinstance(got, _Grant) else got

    def _holder(self, key: str, owner: str, meta: OwnerMeta, ttl_ms: int, fp: str) -> bytes:
        return json.dumps(
            {"key": key, "owner": owner_digest(owner), "task_id": meta.task_id,
             "task_name": meta.task_name, "host": meta.host, "pid": meta.pid,
             "process_start": meta.process_start, "fingerprint": fp, "ttl_ms": ttl_ms},
            separators=(",", ":"),
        ).encode()  # fmt: skip

    def _grant(
        self,
        session: _Session,
        key: str,
        owner: str,
        meta: OwnerMeta,
        record: bool,
        fingerprint: str,
        started: float,
    ) -> _Grant | Busy | JobRecord:
        name = node_name(key)
        p = self._paths(name)
        data = self._holder(key, owner, meta, session.negotiated_ms, fingerprint if record else "")
        keyname = key.encode()
        contended = False
        for _ in range(ATTEMPTS):
            known = name in self._known
            # A key node seen before: a grant is the create plus a set of the key node; a
            # job grant first probes for a record (create and delete of `job`). A new key
            # node is created in the same multi (it has no record yet).
            ops: list[tuple[Any, ...]] = []
            if not known:
                ops.append(("create", p.key, keyname))
            elif record:
                ops += [("create", p.job, b""), ("delete", p.job)]
            ops += [("ephemeral", p.lock, data), ("set", p.key, keyname)]
            got = self._try_grant(session, key, owner, name, p, ops, data, started)
            if isinstance(got, _Grant):
                self._known.add(name)
                return got
            index, exc = got
            op = ops[index]
            if op[0] == "create" and op[1] == p.key:
                if isinstance(exc, NodeExistsError):
                    self._remember(name)
                    continue
                self._make_bucket(session, p)  # NoNode: the bucket (or everything) is missing
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
            if isinstance(exc, NoNodeError):
                if op[1] == p.lock:
                    self._setup(session)  # the locks parent is gone: new (or wiped) data
                self._known.discard(name)
                continue
            raise BackendUnavailable(f"zookeeper begin failed: {exc!r}", key=key, cause=exc)
        if contended:  # a key changing hands this fast is busy: the caller backs off
            return Busy(ttl_left=0.0)
        raise BackendUnavailable(f"zookeeper begin did not settle in {ATTEMPTS} tries", key=key)

    def _remember(self, name: str) -> None:
        if len(self._known) >= KNOWN_KEYS:
            self._known.clear()
        self._known.add(name)

    def _try_grant(
        self,
        session: _Session,
        key: str,
        owner: str,
        name: str,
        p: _Paths,
        ops: list[tuple[Any, ...]],
        data: bytes,
        started: float,
    ) -> _Grant | tuple[int, Exception]:
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
        failed = _failure(results)
        if failed is not None:
            return failed
        stat = results[-1]  # the key node's: one multi, one zxid, so mzxid = the lock's czxid
        self._note_clock(stat.mtime, before, time.time())
        if sid is None or session.sid != sid or sid not in self._base_seen:
            self._orphan(p, owner)  # the session changed meanwhile
            raise BackendUnavailable("zookeeper begin: the session changed", key=key)
        fence = self._fence(session, stat.mzxid)
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
        grant = _Grant(
            key=key, owner=owner, name=name, session=session, sid=sid,
            version=stat.version, fence=fence, data=data, deadline=started + session.ttl,
        )  # fmt: skip
        with self._mutex:
            self._grants[(key, owner)] = grant
        if self.clock.monotonic() >= self._next_prune:
            self._prune_soon()
        return grant

    def _orphan(self, p: _Paths, owner: str) -> None:
        with self._mutex:
            if len(self._orphans) < 10_000:  # a server down for long: each try left one
                self._orphans.append((p.lock, owner_digest(owner)))
        self._wake.set()

    def _make_bucket(self, session: _Session, p: _Paths) -> None:
        try:
            self._create_quietly(session, p.bucket, b"")
        except NoNodeError:
            self._setup(session)

    def _busy(self, session: _Session, key: str, p: _Paths) -> Busy | None:
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
        holder = _json(data)
        ttl = int(holder.get("ttl_ms", session.negotiated_ms)) / 1000
        left = (stat.mtime / 1000 + ttl) - self.server_now()
        if left < -max(STALE_MARGIN, ttl / 2) and self._stale(session, key, p, stat, ttl):
            return None
        return Busy(
            ttl_left=min(ttl, max(0.0, left)),
            task_id=str(holder.get("task_id", "")),
            fingerprint=str(holder.get("fingerprint", "")),
        )

    def _stale(self, session: _Session, key: str, p: _Paths, stat: Any, ttl: float) -> bool:
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
        rec = _json(data)
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
        session: _Session,
        key: str,
        owner: str,
        name: str,
        p: _Paths,
        data: bytes,
        started: float,
    ) -> _Grant | Busy | JobRecord | None:
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
        if isinstance(got, _Grant):
            return got
        index, exc = got
        if ops[index][1] == p.lock and isinstance(exc, NodeExistsError):
            return self._busy(session, key, p)
        return None

    # -- extend, release, commit --------------------------------------------------------------
    def _mine(self, key: str, owner: str) -> _Grant | None:
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
        groups: dict[int, list[tuple[int, _Grant]]] = {}
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
                failed = _failure(answer)
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
        return _failure(answer) is None

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
            failed = _failure(self._multi(mine.session, "commit", key, ops))
            if failed is None:
                ok = True
                break
            if failed[0] != 1 or not isinstance(failed[1], NodeExistsError | NoNodeError):
                break
        with self._mutex:
            if ok:
                self._grants.pop((key, owner), None)
        return ok

    # -- reading --------------------------------------------------------------------------
    def _info(self, key: str, data: bytes, stat: Any) -> LockInfo:
        holder = _json(data)
        ttl = int(holder.get("ttl_ms", 0)) / 1000
        left = (stat.mtime / 1000 + ttl) - self.server_now()
        assert self._base_us is not None
        return LockInfo(
            key=key,
            fence=self._base_us + int(stat.czxid),
            ttl_left=min(ttl, max(0.0, left)),
            host=str(holder.get("host", "")),
            pid=int(holder.get("pid", 0) or 0),
            task_id=str(holder.get("task_id", "")),
            task_name=str(holder.get("task_name", "")),
            acquired_at=stat.ctime / 1000,
            last_heartbeat=stat.mtime / 1000,
            process_start=str(holder.get("process_start", "")),
        )

    def _read(self, session: _Session, what: str, key: str | None, path: str) -> Any:
        try:
            return self._call(session, what, key, lambda: session.client.get_async(path))
        except NoNodeError:
            return None

    def _inspect(self, key: str) -> LockInfo | None:
        session = self._any_session()
        self._fence(session, 0)  # the base, read once per session
        got = self._read(session, "inspect", key, self._paths(node_name(key)).lock)
        return self._info(key, *got) if got is not None else None

    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        session = self._any_session()
        self._fence(session, 0)
        try:
            names = self._call(
                session, "scan", None,
                lambda: session.client.get_children_async(f"{self.root}/locks"),
            )  # fmt: skip
        except NoNodeError:
            return
        pending = [session.client.get_async(f"{self.root}/locks/{n}") for n in sorted(names)]
        self.requests += len(pending)
        found = []
        for answer in pending:
            try:
                data, stat = answer.get(timeout=self.socket_timeout)
            except NoNodeError:
                continue  # released meanwhile
            except (*_TRANSPORT, KazooException) as exc:
                raise BackendUnavailable("zookeeper scan failed", cause=exc) from exc
            key = str(_json(data).get("key", ""))
            if key and fnmatch.fnmatchcase(key, match):
                found.append(self._info(key, data, stat))
        yield from sorted(found, key=lambda i: i.key)

    def job_record(self, key: str) -> JobRecord | None:
        session = self._any_session()
        got = self._read(session, "job_record", key, self._paths(node_name(key)).job)
        if got is None:
            return None
        found = self._record(*got)
        return found[0] if found is not None and found[1] else None

    def forget(self, key: str) -> bool:
        session = self._any_session()
        path = self._paths(node_name(key)).job
        got = self._read(session, "forget", key, path)
        found = self._record(*got) if got is not None else None
        if found is None or not found[1]:
            return False
        try:
            self._call(session, "forget", key,
                       lambda: session.client.delete_async(path, got[1].version))  # fmt: skip
        except (NoNodeError, BadVersionError):
            return False
        return True

    def force_release(self, key: str) -> bool:
        session = self._any_session()
        path = self._paths(node_name(key)).lock
        try:
            self._call(session, "force_release", key, lambda: session.client.delete_async(path))
        except NoNodeError:
            return False
        return True

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock only if it is still the grant of `fence`, in one multi: the key
        node's mzxid is its last grant's czxid, and its version moves with every grant."""
        validate_key(key)
        session = self._any_session()
        p = self._paths(node_name(key))
        base = self._fence(session, 0)
        got = self._read(session, "release_grant", key, p.key)
        if got is None or base + int(got[1].mzxid) != fence:
            return False
        ops = [("check", p.key, got[1].version), ("delete", p.lock)]
        return _failure(self._multi(session, "release_grant", key, ops)) is None

    # -- markers: the queued task, crash-suspect deliveries ----------------------------------
    def _key_node(self, session: _Session, key: str, p: _Paths) -> None:
        """Make the key node (and its bucket) if missing."""
        for _ in range(3):
            try:
                self._create_quietly(session, p.key, key.encode())
                self._remember(node_name(key))
                return
            except NoNodeError:
                self._make_bucket(session, p)
        raise BackendUnavailable("zookeeper: cannot make the key node", key=key)

    def _update(
        self, key: str, path: str, what: str, change: Callable[[dict[str, Any] | None], Any]
    ) -> Any:
        """Compare-and-set loop on a marker node: `change(current or None if missing or
        expired)` returns (new data or None to keep it, answer)."""
        session = self._any_session()
        p = self._paths(node_name(key))
        client = session.client
        for _ in range(ATTEMPTS * 2):
            got = self._read(session, what, key, path)
            current = None
            if got is not None:
                value = _json(got[0])
                expires = got[1].mtime / 1000 + int(value.get("ttl_ms", 0)) / 1000
                current = value if expires > self.server_now() else None
            new, answer = change(current)
            if new is None:
                return answer
            body = json.dumps(new, separators=(",", ":")).encode()
            version = -1 if got is None else got[1].version
            try:
                if got is None:
                    self._call(session, what, key, lambda b=body: client.create_async(path, b))  # type: ignore[misc]
                else:
                    self._call(session, what, key,
                               lambda b=body, v=version: client.set_async(path, b, v))  # type: ignore[misc]  # fmt: skip
                return answer
            except NoNodeError:
                self._key_node(session, key, p)
            except (NodeExistsError, BadVersionError):
                continue
        raise BackendUnavailable(f"zookeeper {what} kept racing", key=key)

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        ttl_ms = max(1, int(ttl * 1000))

        def change(cur: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
            if cur is not None and cur.get("task_id") != task_id:
                return None, str(cur.get("task_id"))
            return {"task_id": task_id, "ttl_ms": ttl_ms}, None

        answer: str | None = self._update(key, self._paths(node_name(key)).queued,
                                          "claim_publish", change)  # fmt: skip
        return answer

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        def change(cur: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
            held = None if cur is None else str(cur.get("task_id"))
            if held is not None and held not in (expect, new):
                return None, held
            if new is None:  # removed: a version-checked write of a claim already expired
                return ({"task_id": "", "ttl_ms": 0} if cur is not None else None), None
            return {"task_id": new, "ttl_ms": ttl_ms}, None

        answer: str | None = self._update(key, self._paths(node_name(key)).queued,
                                          "swap_publish", change)  # fmt: skip
        return answer

    def clear_publish(self, key: str) -> None:
        session = self._any_session()
        path = self._paths(node_name(key)).queued
        with contextlib.suppress(NoNodeError):
            self._call(session, "clear_publish", key, lambda: session.client.delete_async(path))

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        def change(cur: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
            count = int(cur.get("count", 0)) + 1 if cur is not None else 1
            return {"count": count, "ttl_ms": window_ms}, count

        count: int = self._update(key, self._paths(node_name(key)).deliveries,
                                  "count_delivery", change)  # fmt: skip
        return count

    # -- waiting ----------------------------------------------------------------------------
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

    # -- the reaper: deadlines, lost sessions, orphans -----------------------------------------
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

    def _reap_grant(self, grant: _Grant, now: float) -> float:
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

    def _forget(self, grant: _Grant) -> None:
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
            if _json(data).get("owner") == digest:
                self._call(session, "reap", None,
                           lambda: session.client.delete_async(path, stat.version))  # fmt: skip
        except (NoNodeError, BadVersionError):
            pass
        except BackendUnavailable:
            return False
        return True

    # -- housekeeping -----------------------------------------------------------------------
    def _prune_soon(self) -> None:
        self._next_prune = self.clock.monotonic() + self.prune_interval

        def run() -> None:
            try:
                self.prune()
            except BackendUnavailable:
                pass
            except Exception:
                log.exception("zookeeper prune failed")

        threading.Thread(target=run, name="jobfence-zookeeper-prune", daemon=True).start()

    def prune(self, *, force: bool = False) -> int | None:
        """Delete expired records and markers, and key nodes unused for the fence retention;
        None if another process pruned within the interval (`force` skips that turn)."""
        session = self._any_session()
        c = session.client
        turn = f"{self.root}/prune-turn"
        if not force:
            got = self._read(session, "prune", None, turn)
            if got is None:
                self._setup(session)
                self._create_quietly(session, turn, b"")
                got = self._read(session, "prune", None, turn)
            if got is None:
                return None
            stat = got[1]
            if stat.version and stat.mtime / 1000 > self.server_now() - self.prune_interval:
                return None
            try:
                self._call(session, "prune", None, lambda: c.set_async(turn, b"", stat.version))
            except (BadVersionError, NoNodeError):
                return None
        removed = 0
        try:
            buckets = self._call(session, "prune", None,
                                 lambda: c.get_children_async(f"{self.root}/keys"))  # fmt: skip
        except NoNodeError:
            return 0
        for bucket in buckets:
            removed += self._prune_bucket(session, f"{self.root}/keys/{bucket}")
        return removed

    def _gather(self, session: _Session, starts: list[Callable[[], Any]]) -> list[Any]:
        """Send every request at once, then collect: answers (or the server's error)."""
        pending = [start() for start in starts]
        self.requests += len(pending)
        out: list[Any] = []
        for answer in pending:
            try:
                out.append(answer.get(timeout=self.socket_timeout))
            except ZookeeperError as exc:
                if isinstance(exc, _TRANSPORT):
                    raise BackendUnavailable("zookeeper request failed", cause=exc) from exc
                out.append(exc)
            except (KazooTimeoutError, KazooException) as exc:
                raise BackendUnavailable("zookeeper request failed", cause=exc) from exc
        return out

    def _prune_bucket(self, session: _Session, bucket: str) -> int:
        c = session.client
        try:
            names = self._call(session, "prune", None, lambda: c.get_children_async(bucket))
        except NoNodeError:
            return 0
        now = self.server_now()
        removed = 0
        paths = [f"{bucket}/{n}" for n in names]
        listed = self._gather(
            session, [lambda k=k: c.get_children_async(k, include_data=True) for k in paths]  # type: ignore[misc]
        )
        for path, answer in zip(paths, listed, strict=True):
            if isinstance(answer, Exception):
                continue
            children, kstat = answer
            marks = [f"{path}/{child}" for child in children]
            got = self._gather(session, [lambda m=m: c.get_async(m) for m in marks])  # type: ignore[misc]
            left = len(marks)
            for mark, value in zip(marks, got, strict=True):
                if isinstance(value, Exception):
                    continue
                data, stat = value
                if stat.mtime / 1000 + int(_json(data).get("ttl_ms", 0)) / 1000 > now:
                    continue
                deleted = self._gather(
                    session, [lambda m=mark, v=stat.version: c.delete_async(m, v)]  # type: ignore[misc]
                )
                if not isinstance(deleted[0], Exception):
                    removed += 1
                    left -= 1
            if left == 0 and kstat.mtime / 1000 < now - self.fence_retention:
                done = self._gather(session, [lambda k=path, v=kstat.version: c.delete_async(k, v)])  # type: ignore[misc]
                if not isinstance(done[0], NotEmptyError | BadVersionError | NoNodeError):
                    removed += 1
                    self._known.discard(path.rsplit("/", 1)[1])
        return removed

    # -- start-up checks and closing ------------------------------------------------------------
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
