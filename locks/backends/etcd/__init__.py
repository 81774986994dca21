"""The etcd lock backend: leases and txns on etcd's v3 JSON gateway, create revisions as fences."""

from __future__ import annotations

import fnmatch
import functools
import json
import math
import os
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote

from jobfence.config.findings import Finding, LockTarget
from jobfence.config.urls import redact
from jobfence.locks import registry
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    Security,
    validate_key,
    validate_ttl,
)
from jobfence.locks.backends.common import flag_value, server_findings
from jobfence.locks.backends.etcd.gateway import (
    AuthFailed,
    Gateway,
    GatewayError,
    OutcomeUnknown,
    TLSFailed,
    Unreachable,
    b64,
    unb64,
)
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LockError
from jobfence.locks.lease import Lease, OwnerMeta

SCHEMES = registry.entry("etcd").schemes  # the registry is the one list
TLS_SCHEME = registry.entry("etcd").tls_scheme  # as https:// in etcdctl's --endpoints
#: TLS options in the URL's query, named as etcdctl's flags (--cacert, --cert, --key,
#: --insecure-skip-tls-verify).
TLS_OPTIONS = ("cacert", "cert", "key", "insecure_skip_tls_verify")
_CREDENTIAL_OPTIONS = ("user", "username", "password", "pass", "passwd", "token")
PERMISSION_DENIED = 7
USERINFO_FIX = "etcds://user:password@host:2379 (percent-encoded)"
#: Lease TTLs are whole seconds on etcd; shorter asks are raised to this (etcd's own floor
#: is 1.5 election timeouts, 2 s with its defaults).
MIN_TTL = 2
#: A grant attaches the key to the process's lease for that TTL; if that lease was last
#: confirmed more than this fraction of its TTL ago, it is kept alive first (one more round
#: trip), so a new grant always starts with most of its TTL ahead.
REFRESH_FRACTION = 0.4
#: Ops per txn: etcd refuses more than --max-txn-ops (128 by default) in one branch.
TXN_CHUNK = 100
#: Scan reads held locks this many at a time.
SCAN_PAGE = 500
#: Longest one wait_for_release blocks in a watch (the caller loops anyway).
MAX_WAIT = 30.0
VERSION_NEEDED = (3, 4)


@dataclass
class _Session:
    """One etcd lease: `ttl` whole seconds, confirmed alive at `since` (monotonic, send time)."""

    id: str
    ttl: int
    since: float


@dataclass(frozen=True)
class TLS:
    """HTTPS to every member: the server's certificate checked against `cacert` (else the
    system's CAs) and the host name, unless `verify` is off (a downgrade spelled out);
    `cert` and `key` a client certificate (etcd's --client-cert-auth)."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    verify: bool = True

    def context(self) -> ssl.SSLContext:
        """The SSLContext; LockError naming the option whose file cannot be used."""
        try:
            context = ssl.create_default_context(cafile=self.cacert)
        except (OSError, ssl.SSLError) as exc:
            raise LockError(_file_problem("cacert", self.cacert, exc)) from None
        if self.cert:
            try:
                context.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as exc:
                raise LockError(_file_problem("cert/key", f"{self.cert}, {self.key}", exc)) \
                    from None
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def _file_problem(option: str, path: str | None, exc: BaseException) -> str:
    why = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or type(exc).__name__
    return (
        f"the etcd lock URL's {option}={path} cannot be used ({why}); fix: give the path of a "
        "readable PEM file (the key unencrypted)"
    )


@dataclass(frozen=True)
class Target:
    """What an etcd lock URL names. The password never shows in its repr."""

    endpoints: list[str]
    tls: TLS | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)


def _flag(name: str, value: str) -> bool:
    if (flag := flag_value(value)) is not None:
        return flag
    raise ValueError(f"etcd lock URL option {name}={value!r} is not true or false")


def parse_target(url: str) -> Target:
    """`etcd[s]://[user:password@]host:port[,host:port...][?TLS options]`; ValueError with
    the fix, never quoting the password.

    `etcds://` is HTTPS (as `https://` endpoints in etcdctl), verifying the certificate
    against `cacert=` (else the system's CAs) and the host name; `cert=`/`key=` give a client
    certificate; `insecure_skip_tls_verify=true` turns the checks off (a downgrade). The
    user-info (percent-encoded) is an etcd user: its token is asked for with the password.
    """
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"not an etcd URL: {shown.split('://', 1)[0]}:// (use etcd://host:2379)")
    if "#" in rest:
        raise ValueError(f"etcd URL {shown!r} has a fragment; use etcd://host:2379[,host:2379...]")
    rest, _, query = rest.partition("?")
    userinfo, at, hosts = rest.rpartition("@")
    user = password = None
    if at:
        name, colon, secret = userinfo.partition(":")
        user, password = unquote(name), unquote(secret)
        if not user or not colon or not password:
            raise ValueError(
                f"etcd URL {shown!r} has user-info that is not user:password; use {USERINFO_FIX}"
            )
    hosts = hosts.rstrip("/")
    if "/" in hosts:
        raise ValueError(f"etcd URL {shown!r} has a path; use etcd://host:2379[,host:2379...]")
    options: dict[str, str] = {}
    for option, value in parse_qsl(query, keep_blank_values=True):
        if option.lower() in _CREDENTIAL_OPTIONS:
            raise ValueError(
                f"etcd URL {shown!r} has option {option!r}: credentials go in the user-info, "
                f"never the query; use {USERINFO_FIX}"
            )
        if option not in TLS_OPTIONS:
            raise ValueError(
                f"etcd URL {shown!r} has option {option!r}, which etcd URLs do not take; "
                f"known: {', '.join(TLS_OPTIONS)} (TLS, with etcds://)"
            )
        options[option] = value
    endpoints = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host.strip("[]"):
            raise ValueError(f"etcd URL {shown!r}: member {item.strip()!r} is not host:port")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd URL {shown!r} has port {port!r}, not a number in 1-65535")
        endpoints.append(f"{host}:{port}")
    return Target(endpoints, _tls(scheme.lower(), options, shown), user, password)


def _tls(scheme: str, options: dict[str, str], shown: str) -> TLS | None:
    if scheme != TLS_SCHEME:
        if options:
            raise ValueError(
                f"etcd URL {shown!r} gives TLS options ({', '.join(options)}) to etcd://, which "
                f"is plain HTTP; use {TLS_SCHEME}://host:2379?cacert=/path/ca.pem"
            )
        return None
    for name in ("cacert", "cert", "key"):
        if name in options and not options[name]:
            raise ValueError(f"etcd URL option {name}= is empty: give a file path")
    if ("cert" in options) != ("key" in options):
        raise ValueError(
            f"etcd URL {shown!r} gives only one of cert and key; a client certificate needs "
            "both: cert=/path/client.pem&key=/path/client.key"
        )
    verify = not _flag("insecure_skip_tls_verify", options.get("insecure_skip_tls_verify", "0"))
    if not verify and "cacert" in options:
        raise ValueError(
            f"etcd URL {shown!r} gives cacert with insecure_skip_tls_verify=true, which never "
            "reads it; drop insecure_skip_tls_verify (the certificate is then checked)"
        )
    return TLS(options.get("cacert"), options.get("cert"), options.get("key"), verify)


def parse_endpoints(url: str) -> list[str]:
    """host:port of each member in `etcd://host:port[,host:port...]`; ValueError with the fix."""
    return parse_target(url).endpoints


def whole_seconds(ttl_ms: int) -> int:
    """A TTL in ms as etcd can grant it: whole seconds, rounded up, at least MIN_TTL."""
    return max(MIN_TTL, math.ceil(ttl_ms / 1000))


def _lease_gone(exc: BackendUnavailable) -> bool:
    """etcd refused a put on a lease it no longer has (expired, or a new cluster)."""
    return isinstance(exc.cause, GatewayError) and "lease not found" in exc.cause.message


def _kv(response: dict[str, Any]) -> dict[str, Any] | None:
    """The one key-value of a txn's range response, or None if the key is absent."""
    kvs = response.get("response_range", {}).get("kvs") or []
    return kvs[0] if kvs else None


def _value(kv: dict[str, Any] | None) -> str:
    return unb64(kv["value"]) if kv is not None and kv.get("value") else ""


def _range(key: str) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


def _delete(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key)}}


def _put(key: str, value: str, lease: str | None = None) -> dict[str, Any]:
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease is not None:
        put["lease"] = lease
    return {"request_put": put}


def _moved(key: str, lease: str) -> dict[str, Any]:
    """Put `key` on another lease, keeping its value (and its create revision)."""
    return {"request_put": {"key": b64(key), "ignore_value": True, "lease": lease}}


def _absent(key: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def _present(key: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "GREATER", "create_revision": "0"}


def _created_at(key: str, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL",
            "create_revision": str(revision)}  # fmt: skip


def _mod_at(key: str, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def _equals(key: str, value: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _glob_head(match: str) -> str:
    head = ""
    for ch in match:
        if ch in "*?[":
            break
        head += ch
    return head


class EtcdBackend(LockBackend):
    """Locks on an etcd cluster through its v3 JSON gateway. Build with `from_url`.

    Per lock key `k` (under `prefix`): `lock/k` holds the owner token, `holder/k` what
    `inspect` shows, `beat/k` the last heartbeat; all three sit on this process's lease for
    that TTL (one lease per process and TTL, as etcd's own concurrency.Session does), so a
    process that stops keeping its lease alive loses all its locks together. A grant is
    one txn that creates the keys if `lock/k` is absent; the fence is the key's create
    revision above a per-deployment base (µs clock when the base was created), so a new
    cluster (a fresh data directory) starts above every fence an older one issued.
    Job records (`done/k`, `failed/k`) sit on leases that outlive the record's TTL by a
    little, shared by the records of a few seconds, so they cost no round trip of their own.
    """

    name: ClassVar[str] = "etcd"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=False, release_notify=True
    )

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

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float | None = None,  # accepted for open_backend; revisions are kept
        clock: Clock = SYSTEM_CLOCK,
    ) -> EtcdBackend:
        """`etcd[s]://[user:password@]host:port[,host:port...][?cacert=&cert=&key=]`: one
        endpoint, or several members to fail over (see `parse_target`)."""
        del fence_retention
        target = parse_target(url)
        endpoints = target.endpoints
        kind = cls if len(endpoints) == 1 or cls is not EtcdBackend else EtcdClusterBackend
        return kind(endpoints, prefix=prefix, socket_timeout=socket_timeout, clock=clock,
                    tls=target.tls, user=target.user, password=target.password)  # fmt: skip

    def security(self) -> Security:
        """TLS as the URL asked (etcds://, insecure_skip_tls_verify), auth: a user and
        password, or a client certificate."""
        tls = self.tls is not None
        verified = tls and self.tls is not None and self.tls.verify
        return Security(
            tls=tls,
            verified=verified,
            hostname_checked=verified,
            auth=self.user is not None or (self.tls is not None and self.tls.cert is not None),
        )

    @staticmethod
    def granted_ttl(ttl: float) -> float:
        """The TTL a lease asked for `ttl` seconds really gets (at least; etcd may raise it
        to its own floor, and the Lease then reports that)."""
        return float(whole_seconds(validate_ttl(ttl)))

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
        where = self.gateway.endpoint
        if isinstance(exc, GatewayError) and "CommonName of client" in exc.message:
            return (f"etcd at {where} refuses a client certificate with a Common Name on "
                    "its JSON gateway while authentication is on (the CN would not be "
                    "used as the user)",
                    "issue the client certificate (cert= in the lock URL) with no CN, "
                    "naming the client in a subject alternative name, and authenticate "
                    "as user:password@ in the URL")  # fmt: skip
        if isinstance(exc, AuthFailed):
            return (f"etcd at {where} refused the login of user {self.user!r} ({exc.message})",
                    "check the user and password in the lock URL: " + USERINFO_FIX)  # fmt: skip
        if isinstance(exc, GatewayError):
            no_user = "user name is empty" in exc.message or (
                exc.code == PERMISSION_DENIED and self.user is None
            )
            if no_user and self.user is None:
                return (f"etcd at {where} has authentication on and the lock URL names no user "
                        f"({exc.message})",
                        "put a user and password in the lock URL: " + USERINFO_FIX)  # fmt: skip
            if exc.code == PERMISSION_DENIED:
                return (f"etcd at {where} denies user {self.user!r} the keys under "
                        f"'{self.prefix}/' ({exc.message})",
                        f"grant the user a role with readwrite on that prefix: etcdctl role "
                        f"grant-permission ROLE readwrite --prefix=true '{self.prefix}/'; etcdctl "
                        "user grant-role USER ROLE")  # fmt: skip
            return None
        if isinstance(exc, TLSFailed):
            return _tls_problem(exc, where)
        return None

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

    # -- fence base ---------------------------------------------------------------------
    def _fence_base(self, key: str | None) -> tuple[int, str]:
        """(base, its stored text): read once, created the first time a deployment needs it."""
        base = self._base
        if base is not None:
            return base
        found = _kv(self._read("fence base", key, [_range(self._base_key)])[0])
        if found is None:
            # Above this client's clock, the server's (Date header, whole seconds) and every
            # fence this client has seen; whoever creates it first wins.
            proposed = str(max(int(time.time() * 1e6), self.gateway.date_us(),
                               self.fence_floor + 1))  # fmt: skip
            reply = self._txn(
                "fence base",
                key,
                [_absent(self._base_key)],
                [_put(self._base_key, proposed)],
                [_range(self._base_key)],
            )
            text = proposed if reply.get("succeeded") else _value(_kv(reply["responses"][0]))
        else:
            text = _value(found)
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

    # -- acquire -------------------------------------------------------------------------
    def _on_grant(self, lease: Lease) -> None:
        # The key lives as long as the process lease it sits on: its deadline counts from
        # that lease's last confirmation, with the TTL etcd granted (whole seconds).
        since, granted = self._granted.pop(lease.owner)
        lease.renewed(since, float(granted))

    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        ttl = whole_seconds(ttl_ms)
        lock, holder, beat = (self._key(k, key) for k in ("lock", "holder", "beat"))
        done, failed = self._key("done", key), self._key("failed", key)
        now = time.time()
        # A grant or release of ours that got no answer may still hold a key (maybe this
        # one), kept alive by this very process's lease: delete those first.
        self._sweep()
        for _ in range(4):
            base, base_text = self._fence_base(key)
            session = self._session(ttl, key)
            shown = json.dumps({
                "host": meta.host, "pid": meta.pid, "task_id": meta.task_id,
                "task_name": meta.task_name, "process_start": meta.process_start,
                "fingerprint": fingerprint if record else "", "acquired": now,
                "ttl": session.ttl,
            }, separators=(",", ":"))  # fmt: skip
            compare = [_absent(lock), _equals(self._base_key, base_text)]
            success = [_put(lock, owner, session.id), _put(holder, shown, session.id),
                       _put(beat, repr(now), session.id)]  # fmt: skip
            failure = [_range(lock), _range(holder), _range(self._base_key)]
            if record:
                compare.append(_absent(done))
                success.append(_delete(failed))  # an earlier run's FAILED record goes
                failure.append(_range(done))
            try:
                reply = self._txn("begin", key, compare, success, failure,
                                  suspect=(key, owner))  # fmt: skip
            except BackendUnavailable as exc:
                if _lease_gone(exc):
                    self._drop_session(session.id)  # expired meanwhile: take a new one
                    continue
                raise
            revision = int(reply["header"]["revision"])
            if reply.get("succeeded"):
                fence = base + revision  # the keys' create revision, above the base
                if fence > self.fence_floor:
                    self.fence_floor = fence
                self._granted[owner] = (session.since, session.ttl)
                return fence
            responses = reply["responses"]
            held, info, stored = (_kv(r) for r in responses[:3])
            if stored is None or _value(stored) != base_text:
                self._base = None  # a new cluster or a restore: take its base, and again
                continue
            if record and (rec := _kv(responses[3])) is not None:
                return self._record("DONE", _value(rec))
            if held is not None:
                self._local.busy = (key, revision)  # wait_for_release watches from here
                holder_fields = json.loads(_value(info) or "{}")
                # The holder's lease TTL bounds its time left (its keeper renews it every
                # third of it); asking etcd for the exact figure would cost a round trip
                # per refused attempt, and waiters are woken by a watch anyway.
                return Busy(
                    ttl_left=float(holder_fields.get("ttl", ttl)),
                    task_id=str(holder_fields.get("task_id", "")),
                    fingerprint=str(holder_fields.get("fingerprint", "")),
                )
        raise BackendUnavailable("etcd begin did not settle (lease or fence base kept changing)",
                                 key=key)  # fmt: skip

    def _ttl_left(self, held: dict[str, Any], key: str) -> float:
        """Seconds until the holder's lease ends at the latest (etcd reports whole seconds,
        rounded down); 0 if it has already ended."""
        lease = held.get("lease")
        if not lease:
            return 0.0
        reply = self._call("lease ttl", key, "/v3/lease/timetolive", {"ID": lease},
                           idempotent=True)  # fmt: skip
        left = int(reply.get("TTL", 0))
        granted = int(reply.get("grantedTTL", 0))
        if left < 0 or granted <= 0:
            return 0.0
        return float(min(left + 1, granted))

    @staticmethod
    def _record(state: str, text: str) -> JobRecord:
        fields = json.loads(text or "{}")
        return JobRecord(
            state=state,
            fingerprint=str(fields.get("fingerprint", "")),
            result=str(fields.get("result", "")),
            fence=int(fields.get("fence", 0)),
            finished_at=float(fields.get("finished", 0.0)),
        )

    # -- extend ------------------------------------------------------------------------
    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        # Renewed now (within this call), so the caller's deadline from its start holds;
        # the keys move onto that lease, which is another one if the TTL changed.
        session = self._session(whole_seconds(ttl_ms), key, max_age=0.0)
        lock, holder, beat = (self._key(k, key) for k in ("lock", "holder", "beat"))
        reply = self._txn(
            "extend",
            key,
            [_equals(lock, owner), _present(holder)],
            [_moved(lock, session.id), _moved(holder, session.id),
             _put(beat, repr(time.time()), session.id)],
        )  # fmt: skip
        return bool(reply.get("succeeded"))

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        """One txn checks every key is still ours and stamps its heartbeat (reading which
        lease it sits on); then one keep-alive per lease. A lease etcd no longer has loses
        all its keys."""
        self._sweep()
        results = [False] * len(items)
        by_lease: dict[str, list[int]] = {}
        now = repr(time.time())
        for chunk in _txn_chunks(items):
            ops = []
            for key, owner, _ in (items[i] for i in chunk):
                lock, beat = self._key("lock", key), self._key("beat", key)
                ops.append({"request_txn": {
                    "compare": [_equals(lock, owner), _present(beat)],
                    "success": [{"request_put": {"key": b64(beat), "value": b64(now),
                                                 "ignore_lease": True}}, _range(lock)],
                }})  # fmt: skip
            reply = self._txn("extend_many", None, [], ops)
            for offset, response in enumerate(reply.get("responses", [])):
                nested = response.get("response_txn", {})
                if not nested.get("succeeded"):
                    continue
                held = _kv(nested["responses"][1])
                if held is not None and held.get("lease"):
                    by_lease.setdefault(str(held["lease"]), []).append(chunk[offset])
        for lease_id, indexes in by_lease.items():
            sent = self.clock.monotonic()
            if self._keepalive(lease_id, None) > 0:
                self._confirmed(lease_id, sent)
                for i in indexes:
                    results[i] = True
            else:
                self._drop_session(lease_id)
        return results

    def _sweep(self) -> None:
        """Delete grants whose acquire or release had no answer, if they are still ours."""
        if not self._suspects:
            return
        suspects = list(self._suspects)[:TXN_CHUNK]
        ops = []
        for key, owner in suspects:
            lock = self._key("lock", key)
            ops.append({"request_txn": {
                "compare": [_equals(lock, owner)],
                "success": [_delete(lock), _delete(self._key("holder", key)),
                            _delete(self._key("beat", key))],
            }})  # fmt: skip
        try:
            self._txn("sweep", None, [], ops)
        except BackendUnavailable:
            return  # the next call tries again
        for suspect in suspects:
            self._suspects.pop(suspect, None)

    # -- release and commit ----------------------------------------------------------------
    def _release(self, key: str, owner: str) -> bool:
        lock = self._key("lock", key)
        reply = self._txn(
            "release",
            key,
            [_equals(lock, owner)],
            [_delete(lock), _delete(self._key("holder", key)), _delete(self._key("beat", key))],
            suspect=(key, owner),
        )
        return bool(reply.get("succeeded"))

    def _commit(self, rec: CommitRecord) -> bool:
        key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
        lock = self._key("lock", key)
        base, _ = self._fence_base(key)  # another base (a new cluster): no key of ours left
        text = json.dumps({"fingerprint": fingerprint, "result": result, "fence": fence,
                           "finished": time.time()}, separators=(",", ":"))  # fmt: skip
        mine, other = ("done", "failed") if state == "DONE" else ("failed", "done")

        def send(lease: str) -> dict[str, Any]:
            return self._txn(
                "commit",
                key,
                # The owner token and the grant's create revision: this grant, no other.
                [_equals(lock, owner), _created_at(lock, fence - base)],
                [_put(self._key(mine, key), text, lease), _delete(self._key(other, key)),
                 _delete(lock), _delete(self._key("holder", key)),
                 _delete(self._key("beat", key))],
                suspect=(key, owner),
            )  # fmt: skip

        reply = self._on_timed_lease(result_ttl_ms / 1000, key, send)
        return bool(reply.get("succeeded"))

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
                if attempt == 0 and _lease_gone(exc):
                    self._drop_session(lease)
                    continue
                raise
        raise AssertionError("unreachable")

    # -- inspect and admin ---------------------------------------------------------------
    def _inspect(self, key: str) -> LockInfo | None:
        held, info, beat = (
            _kv(r)
            for r in self._read(
                "inspect",
                key,
                [_range(self._key(k, key)) for k in ("lock", "holder", "beat")],
            )
        )
        if held is None:
            return None
        return self._info(key, held, info, beat)

    def _info(
        self,
        key: str,
        held: dict[str, Any],
        info: dict[str, Any] | None,
        beat: dict[str, Any] | None,
        ttl_left: Callable[[dict[str, Any]], float] | None = None,
    ) -> LockInfo:
        base, _ = self._fence_base(key)
        fields = json.loads(_value(info) or "{}")
        acquired = float(fields.get("acquired", 0.0))
        beat_text = _value(beat)
        return LockInfo(
            key=key,
            fence=base + int(held.get("create_revision", 0)),
            ttl_left=(ttl_left or (lambda h: self._ttl_left(h, key)))(held),
            host=str(fields.get("host", "")),
            pid=int(fields.get("pid", 0)),
            task_id=str(fields.get("task_id", "")),
            task_name=str(fields.get("task_name", "")),
            acquired_at=acquired,
            last_heartbeat=float(beat_text) if beat_text else acquired,
            process_start=str(fields.get("process_start", "")),
        )

    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        """Held locks matching `match`, read a page at a time (each page one range, one txn
        for what `inspect` shows, one TTL query per distinct lease)."""
        head = f"{self.prefix}/lock/"
        start = (head + _glob_head(match)).encode()
        end = _prefix_end(start)
        while True:
            body = {"key": b64(start), "range_end": b64(end), "limit": str(SCAN_PAGE)}
            reply = self._call("scan", None, "/v3/kv/range", body, idempotent=True)
            kvs = reply.get("kvs") or []
            keys = [unb64(kv["key"])[len(head):] for kv in kvs]
            wanted = [(k, kv) for k, kv in zip(keys, kvs, strict=True)
                      if fnmatch.fnmatchcase(k, match)]  # fmt: skip
            yield from self._page(wanted)
            if not reply.get("more") or not kvs:
                return
            start = _after(unb64(kvs[-1]["key"]))

    def _page(self, wanted: list[tuple[str, dict[str, Any]]]) -> Iterator[LockInfo]:
        if not wanted:
            return
        ops = []
        for key, _ in wanted:
            ops += [_range(self._key("holder", key)), _range(self._key("beat", key))]
        responses: list[Any] = []
        for start in range(0, len(ops), TXN_CHUNK):
            responses += self._read("scan", None, ops[start : start + TXN_CHUNK])
        ttls: dict[str, float] = {}

        def ttl_left(held: dict[str, Any]) -> float:
            lease = str(held.get("lease", ""))
            if lease not in ttls:
                ttls[lease] = self._ttl_left(held, "")
            return ttls[lease]

        for i, (key, held) in enumerate(wanted):
            yield self._info(key, held, _kv(responses[2 * i]), _kv(responses[2 * i + 1]),
                             ttl_left)  # fmt: skip

    def job_record(self, key: str) -> JobRecord | None:
        ops = [_range(self._key("done", key)), _range(self._key("failed", key))]
        done, failed = (_kv(r) for r in self._read("job_record", key, ops))
        if done is not None:
            return self._record("DONE", _value(done))
        if failed is not None:
            return self._record("FAILED", _value(failed))
        return None

    def forget(self, key: str) -> bool:
        reply = self._txn(
            "forget", key, [], [_delete(self._key("done", key)), _delete(self._key("failed", key))]
        )
        return any(
            int(r.get("response_delete_range", {}).get("deleted", 0)) for r in reply["responses"]
        )

    def force_release(self, key: str) -> bool:
        reply = self._txn(
            "force_release",
            key,
            [],
            [_delete(self._key(k, key)) for k in ("lock", "holder", "beat")],
        )
        return bool(int(reply["responses"][0].get("response_delete_range", {}).get("deleted", 0)))

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock if still held under `fence`, in one txn: the fence is the
        base plus the lock key's create revision, so etcd compares both as it deletes."""
        validate_key(key)
        base, base_text = self._fence_base(key)
        if fence <= base:
            return False  # no grant under this base: another cluster's, or none
        lock = self._key("lock", key)
        reply = self._txn(
            "release_grant",
            key,
            [_created_at(lock, fence - base), _equals(self._base_key, base_text)],
            [_delete(self._key(k, key)) for k in ("lock", "holder", "beat")],
        )
        return bool(reply.get("succeeded"))

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        queued = self._key("queued", key)

        def send(lease: str) -> dict[str, Any]:
            return self._txn(
                "claim_publish",
                key,
                [_absent(queued)],
                [_put(queued, task_id, lease)],
                [{"request_txn": {
                    "compare": [_equals(queued, task_id)],
                    "success": [_put(queued, task_id, lease)],
                    "failure": [_range(queued)],
                }}],
            )  # fmt: skip

        reply = self._on_timed_lease(ttl, key, send)
        if reply.get("succeeded"):
            return None
        nested = reply["responses"][0].get("response_txn", {})
        if nested.get("succeeded"):
            return None
        held = _value(_kv(nested["responses"][0]))
        return held if held and held != task_id else None

    def clear_publish(self, key: str) -> None:
        self._txn("clear_publish", key, [], [_delete(self._key("queued", key))])

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        queued = self._key("queued", key)

        def send(lease: str | None) -> dict[str, Any]:
            change = [_delete(queued) if new is None else _put(queued, new, lease)]
            # absent, or expect, or new: nested txns, each falling through to the next test
            last: list[dict[str, Any]] = [_range(queued)]
            for value in [expect] + ([new] if new is not None and new != expect else []):
                last = [{"request_txn": {
                    "compare": [_equals(queued, value)], "success": change, "failure": last}}]
            return self._txn("swap_publish", key, [_absent(queued)], change, last)

        reply = send(None) if new is None else self._on_timed_lease(ttl_ms / 1000, key, send)
        while not reply.get("succeeded"):
            inner = reply["responses"][0]
            if "response_txn" not in inner:
                return _value(_kv(inner)) or None
            reply = inner["response_txn"]
        return None

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        name = self._key("deliveries", key)
        for _ in range(8):  # racing increments: re-read and try again
            kv = _kv(self._read("count_delivery", key, [_range(name)])[0])
            count = int(_value(kv) or 0) + 1
            revision = int(kv.get("mod_revision", 0)) if kv is not None else 0
            guard = _mod_at(name, revision) if kv is not None else _absent(name)
            put = functools.partial(self._put_guarded, "count_delivery", key, guard, name, count)
            reply = self._on_timed_lease(window_ms / 1000, key, put)
            if reply.get("succeeded"):
                return count
        raise BackendUnavailable("etcd count_delivery kept racing", key=key)

    def _put_guarded(
        self, what: str, key: str, guard: dict[str, Any], name: str, value: object, lease: str
    ) -> dict[str, Any]:
        return self._txn(what, key, [guard], [_put(name, str(value), lease)])

    # -- waiting -------------------------------------------------------------------------
    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block until `key` is deleted (released, committed, expired) or `timeout` passes.

        A watch from the revision at which this thread's last refused attempt saw the key
        held, so a release between that answer and this wait is not missed. If the watch
        cannot be set up, sleeps the timeout instead (the caller polls).
        """
        timeout = min(timeout, MAX_WAIT)
        if timeout < 0.001:
            return
        busy = getattr(self._local, "busy", None)
        self._local.busy = None
        lock = self._key("lock", key)
        if busy is not None and busy[0] == key:
            revision = int(busy[1])
        else:
            try:
                reply = self._call("wait", key, "/v3/kv/range", {"key": b64(lock)},
                                   idempotent=True)  # fmt: skip
            except BackendUnavailable as exc:
                if not isinstance(exc.cause, GatewayError):
                    raise
                self.clock.sleep(timeout)  # etcd answered, but not this: poll
                return
            if not reply.get("kvs"):
                return  # not held now
            revision = int(reply["header"]["revision"])
        try:
            self.gateway.wait_deleted(lock.encode(), revision + 1, timeout)
        except (Unreachable, OutcomeUnknown) as exc:
            raise BackendUnavailable("etcd wait failed", key=key, cause=exc) from exc
        except GatewayError:
            self.clock.sleep(timeout)

    # -- checks and housekeeping ------------------------------------------------------------
    def _ping(self) -> str:
        return f"etcd {self.gateway.get('/version').get('etcdserver', '?')}"

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        return server_findings(target, self.server_problems)

    def server_problems(self) -> list[tuple[str, str]]:
        """What in the server breaks this backend (start-up check): (problem, fix) pairs."""
        try:
            reply = self.gateway.get("/version")
            # A read under the prefix: the TLS set-up, the login and the user's permission.
            self._read("check", None, [_range(self._base_key)])
        except SetupError as exc:
            return [(exc.problem, exc.fix)]
        except (Unreachable, GatewayError) as exc:
            found = self.setup_problem(exc)
            if found is not None:
                return [found]
            if self.tls is None and (tls_at := self._serving_tls()):
                return [(f"etcd at {tls_at} serves HTTPS and the lock URL is etcd:// (plain "
                         "HTTP)", f"use {TLS_SCHEME}://host:port?cacert=/path/ca.pem (the CA of "
                         "etcd's --cert-file)")]  # fmt: skip
            raise BackendUnavailable("etcd check failed", cause=exc) from exc
        version = str(reply.get("etcdserver", "0.0"))
        try:
            numbers = tuple(int(x) for x in version.split(".")[:2])
        except ValueError:
            numbers = (0, 0)
        if numbers < VERSION_NEEDED:
            return [(f"the etcd server is version {version}: its JSON gateway is not at /v3",
                     "run etcd 3.4 or later")]  # fmt: skip
        try:
            alarms = self._call("alarms", None, "/v3/maintenance/alarm", {"action": "GET"},
                                idempotent=True)  # fmt: skip
        except SetupError:
            return []  # a user without the root role may not list alarms
        return [
            (f"the etcd server has alarm {alarm.get('alarm', '?')} raised, so it refuses writes",
             "compact and defragment it (etcdctl compact/defrag), then etcdctl alarm disarm")
            for alarm in alarms.get("alarms") or []
        ]  # fmt: skip

    def _serving_tls(self) -> str | None:
        """The first member that answers a TLS handshake (certificate unchecked: only to
        tell a plain etcd:// URL that its server speaks HTTPS), or None."""
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        for endpoint in self.endpoints:
            host, _, port = endpoint.rpartition(":")
            try:
                address = (host.strip("[]"), int(port))
                with (
                    socket.create_connection(address, timeout=self.socket_timeout) as raw,
                    probe.wrap_socket(raw, server_hostname=None),
                ):
                    return endpoint
            except ssl.SSLError as exc:  # an alert: TLS after all (it wanted a client cert)
                if "ALERT" in str(exc):
                    return endpoint
            except OSError:
                continue
        return None

    def close(self) -> None:
        self._sweep()  # best effort: errors wait for the leases to run out
        self.gateway.close()


class SetupError(LockError):
    """etcd refused the TLS session or the login: a set-up to fix, no outage to wait out.
    The message says `problem` and `fix`; it never holds the password or a token."""

    def __init__(self, problem: str, fix: str, *, key: str | None = None,
                 cause: BaseException | None = None) -> None:  # fmt: skip
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; fix: {fix}", key=key, cause=cause)


def _tls_problem(exc: TLSFailed, where: str) -> tuple[str, str]:
    """(problem, fix) for a TLS session etcd or this client refused."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    text = " ".join(str(e) for e in seen)
    verify = [e for e in seen if isinstance(e, ssl.SSLCertVerificationError)]
    host = where.rpartition(":")[0]
    detail = f"{type(seen[-1]).__name__}: {seen[-1]}"
    if verify or "CERTIFICATE_VERIFY_FAILED" in text:
        why = (verify[0].verify_message if verify else "") or "untrusted"
        if (verify and verify[0].verify_code == 62) or "mismatch" in why:
            return (f"etcd's TLS certificate at {where} is not valid for host {host!r} ({why})",
                    "connect by a name or address the certificate holds; or, a downgrade the "
                    "start-up check warns about, add insecure_skip_tls_verify=true to the "
                    "lock URL")  # fmt: skip
        return (f"etcd's TLS certificate at {where} did not verify ({why})",
                "pass the CA that signed it as cacert=/path/ca.pem in the lock URL (etcdctl's "
                "--cacert)")  # fmt: skip
    low = text.lower()
    if "wrong_version_number" in low or "wrong version number" in low:
        return (f"etcd at {where} does not speak TLS on this port",
                "use etcd:// (plain HTTP), or turn TLS on at the server (--cert-file, "
                "--key-file)")  # fmt: skip
    return (f"etcd at {where} refused the TLS session ({detail}): it may require a client "
            "certificate from its CA (--client-cert-auth)",
            "pass cert=/path/client.pem&key=/path/client.key in the lock URL (etcdctl's --cert "
            "and --key), signed by the CA of etcd's --trusted-ca-file")  # fmt: skip


def _after(key: str) -> bytes:
    """The smallest key after `key` (for paging a range)."""
    return key.encode() + b"\0"


class EtcdClusterBackend(EtcdBackend):
    """An EtcdBackend given several members: it fails over between them, so it survives the
    loss of one (a majority must stay up for etcd to answer at all)."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=True, release_notify=True
    )


def _txn_chunks(items: Sequence[tuple[str, str, int]]) -> list[list[int]]:
    """The indexes of `items` in txns of at most TXN_CHUNK, each naming a key once: etcd
    refuses a txn that names one key twice, and a batch may (a lost lease and the new one)."""
    chunks: list[list[int]] = []
    keys: set[str] = set()
    for i, (key, _, _) in enumerate(items):
        if not chunks or len(chunks[-1]) >= TXN_CHUNK or key in keys:
            chunks.append([])
            keys = set()
        chunks[-1].append(i)
        keys.add(key)
    return chunks
