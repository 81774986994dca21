"""Redlock over N independent Redis masters, with a fencing token that only goes up."""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from jobfence.config.findings import Finding, LockTarget
from jobfence.config.settings import Settings
from jobfence.config.urls import redlock_masters
from jobfence.locks.backend import (
    Busy,
    Capabilities,
    CommitRecord,
    JobRecord,
    LockBackend,
    LockInfo,
    Security,
    validate_key,
)
from jobfence.locks.backends.common import settings_options
from jobfence.locks.backends.redis.scripts import script_source
from jobfence.locks.backends.redis.url import (
    security,
    tls_context,
    tls_hint,
    tls_kwargs,
    url_tls,
)
from jobfence.locks.clock import SYSTEM_CLOCK, Clock
from jobfence.locks.errors import BackendUnavailable, LockError
from jobfence.locks.keys import KeySpace
from jobfence.locks.lease import DRIFT_FLOOR, DRIFT_FRACTION, OwnerMeta

# How the masters are asked in parallel: each master has plain non-blocking sockets of ours
# (one per concurrent operation), a command is sent to every master, then poll() reads the
# replies as they come. No thread pool: on the hot path a hand-off to threads costs more
# than the round trip, and a fork never inherits a pool. Not redis-py's connections: their
# reads block one connection at a time and drop the connection on a timeout, which would
# lose the order of commands to a slow master (below) and the replies still on their way.
SIGNAL_LIFETIME_MS = 2000
DEFAULT_FENCE_RETENTION = 30 * 24 * 3600.0
#: How far ahead of this host's clock a one-round proposal is made, in µs: it must clear the
#: masters' clocks plus the trip there, or the grant falls back to the second phase.
PROPOSAL_LEAD_US = 20_000
#: Replies a connection may owe (commands sent to a master that has not answered yet) before
#: it is dropped: a master that far behind is treated as down.
MAX_OWED = 64
MARKED_KEYS_KEPT = 1024  # keys refused and not yet waited on, per client
#: After a failed connect, a master is skipped (counted as not answering) this long.
RECONNECT_DELAY = 0.5
SCRIPTS = (
    "redlock_begin",
    "redlock_fence",
    "redlock_commit",
    "redlock_inspect",
    "redlock_admin",
    "release",
    "extend",
    "extend_many",
    "claim_publish",
    "swap_publish",
)


class _ErrorReply(str):
    """An error reply from a master (a script error, NOSCRIPT, READONLY ...)."""


class _Missing:
    """No reply from a master: it was down, the connection broke, or the deadline passed."""

    def __repr__(self) -> str:
        return "<no reply>"


NO_REPLY: Any = _Missing()
_MORE = object()  # the buffer ends inside a reply


def _parse(buf: bytearray, pos: int) -> tuple[Any, int] | object:
    """One RESP2 reply from `buf` at `pos`: (value, next position), or _MORE if incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _MORE
    kind = buf[pos]
    if kind == 0x2A:  # '*' array
        n = int(buf[pos + 1 : end])
        if n < 0:
            return None, end + 2
        items: list[Any] = []
        pos = end + 2
        for _ in range(n):
            got = _parse(buf, pos) if buf[pos : pos + 1] == b"*" else _scalar(buf, pos)
            if not isinstance(got, tuple):
                return _MORE
            items.append(got[0])
            pos = got[1]
        return items, pos
    return _scalar(buf, pos)


def _scalar(buf: bytearray, pos: int) -> tuple[Any, int] | object:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _MORE
    kind = buf[pos]
    if kind == 0x3A:  # ':' integer
        return int(buf[pos + 1 : end]), end + 2
    if kind == 0x24:  # '$' bulk string
        n = int(buf[pos + 1 : end])
        if n < 0:
            return None, end + 2
        start = end + 2
        if len(buf) < start + n + 2:
            return _MORE
        return buf[start : start + n].decode(), start + n + 2
    if kind == 0x2B:  # '+' simple string
        return buf[pos + 1 : end].decode(), end + 2
    if kind == 0x2D:  # '-' error
        return _ErrorReply(buf[pos + 1 : end].decode()), end + 2
    raise ValueError(f"unexpected reply type {chr(kind)!r} from a redlock master")


def _pack(*args: Any) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else b"%d" % arg
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class Replies:
    """What one connection to a master has read, and how many replies it still owes.

    Commands go out without waiting for earlier replies (a master that is slow to answer
    keeps receiving them, in order, on this one connection), so what was sent to a master
    runs there in the order sent, even when the client stopped waiting: a release sent after
    an acquire it never saw answered still removes that acquire's key. The sync backend's
    sockets and the asyncio store's connections (redlock_async.py) both read through this.
    """

    __slots__ = ("buf", "owed")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.owed = 0

    def take(self) -> Any:
        """The next complete reply in the buffer, or _MORE."""
        got = _parse(self.buf, 0)
        if not isinstance(got, tuple):
            return _MORE
        del self.buf[: got[1]]
        self.owed -= 1
        return got[0]


class _Link(Replies):
    """One blocking-free socket to one master (TLS-wrapped for rediss://), for one sync
    operation at a time."""

    __slots__ = ("error", "fd", "sock", "tls")

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.fd = sock.fileno()
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.error: OSError | None = None  # why the last read failed

    def recv(self) -> bytes | None:
        """What the socket has now: None if nothing yet (for TLS, a record still partial,
        or a protocol message such as a session ticket with no data), b"" if it closed."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError as exc:  # reset, or a TLS alert (a client certificate refused)
            self.error = exc
            return b""
        if self.tls and data:
            # Decrypted bytes the TLS layer holds already: poll() would not report them.
            sock: Any = self.sock
            while pending := sock.pending():
                data += sock.recv(pending)
        return data

    def send(self, data: bytes) -> bool:
        try:
            sent = self.sock.send(data)
        except OSError as exc:
            self.error = exc
            return False
        if sent != len(data):  # the master is so far behind its buffers are full
            return False
        self.owed += 1
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Master:
    """One Redlock master: its address, idle links, and a redis-py client for admin calls."""

    def __init__(self, url: str, *, socket_timeout: float, scripts: dict[str, str]) -> None:
        opts = parse_url(url)  # type: ignore[no-untyped-call]
        self.host = str(opts.get("host", "127.0.0.1"))
        self.port = int(opts.get("port", 6379))
        self.db = int(opts.get("db", 0) or 0)
        self.username = opts.get("username")
        self.password = opts.get("password")
        self.name = f"{self.host}:{self.port}"
        self.url = url
        self.socket_timeout = socket_timeout
        self.scripts = scripts
        # rediss://: our sockets wrapped in TLS, the certificate and the host name checked
        # (unless the URL turns a check off), as redis-py's client below does.
        self.tls = url_tls(url)
        self.ssl_context = tls_context(self.tls)
        tls = {k: v for k, v in tls_kwargs(self.tls).items() if k != "ssl"}
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            decode_responses=True,
            health_check_interval=0,
            retry=Retry(NoBackoff(), 0),
            **tls,
        )
        #: Why the last connection to this master failed (a TLS handshake, say), for the
        #: hint of BackendUnavailable; None once it answers again.
        self.last_error: BaseException | None = None
        self.idle: list[_Link] = []
        self.pid = os.getpid()
        self.down_until = 0.0

    def checkout(self, pid: int) -> _Link | None:
        """An idle link, or a new one; None while the master refuses connections."""
        if self.pid != pid:  # a forked child: the parent's sockets are not ours
            self.pid, self.idle = pid, []
        try:
            return self.idle.pop()
        except IndexError:
            pass
        if time.monotonic() < self.down_until:
            return None
        try:
            return self.connect()
        except OSError as exc:
            self.last_error = exc
            self.down_until = time.monotonic() + RECONNECT_DELAY
            return None

    def checkin(self, link: _Link, pid: int) -> None:
        if self.pid == pid:
            self.idle.append(link)

    def connect(self) -> _Link:
        """A new link, its set-up (AUTH, SELECT, every script) sent but not waited for.

        The set-up's replies are read, and dropped, ahead of the first command's, so a
        master that is frozen costs no more than one that is slow; a failed AUTH shows as
        the NOAUTH error of the commands after it.
        """
        sock = socket.create_connection((self.host, self.port), timeout=self.socket_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:  # the handshake, blocking, within the timeout
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            setup = self.setup()
            sock.setblocking(False)
            link = _Link(sock)
            if not link.send(b"".join(setup)):
                raise ConnectionError(f"redlock master {self.name}: set-up not sent "
                                      f"({link.error})") from link.error  # fmt: skip
            link.owed = len(setup)
            return link
        except BaseException:
            sock.close()
            raise

    def setup(self) -> list[bytes]:
        """What a new connection sends first, without waiting: AUTH, SELECT, every script."""
        setup: list[bytes] = []
        if self.password:
            auth = (self.username, self.password) if self.username else (self.password,)
            setup.append(_pack("AUTH", *auth))
        if self.db:
            setup.append(_pack("SELECT", self.db))
        return setup + self.script_loads()

    def script_loads(self) -> list[bytes]:
        return [_pack("SCRIPT", "LOAD", src) for src in self.scripts.values()]

    def close(self, deadline: float) -> None:
        """Read what idle links still owe (until `deadline`), then close everything."""
        idle, self.idle = self.idle, []
        if self.pid == os.getpid():
            for link in idle:
                _drain(link, deadline)
                link.close()
        self.client.close()


def _drain(link: _Link, deadline: float) -> None:
    while link.owed:
        try:
            got = link.take()
        except ValueError:
            return
        if got is not _MORE:
            continue
        left = deadline - time.monotonic()
        poller = select.poll()
        poller.register(link.fd, select.POLLIN)
        if left <= 0 or not poller.poll(left * 1000):
            return
        data = link.recv()
        if data == b"":
            return
        link.buf += data or b""


Decide = Callable[[dict[int, Any], int], bool]
T = TypeVar("T")


def _never(replies: dict[int, Any], pending: int) -> bool:
    return False


@dataclass(frozen=True)
class Round:
    """One command sent to some masters at once, and how long their replies are awaited.

    Every Redlock operation is a generator of rounds (`Rounds`): it yields a Round, gets
    back a reply (or NO_REPLY) per target master, and returns its answer. The quorum, the
    validity, the fence and the clean-up are decided there once; the sync backend
    (`RedlockBackend._run`) and the asyncio store (redlock_async.py) only carry rounds.
    """

    payload: bytes
    deadline: float  # time.monotonic(); 0: send and do not wait (a clean-up on the way out)
    decided: Decide = _never  # stop reading once it says so, before the deadline
    targets: Sequence[int] | None = None  # None: every master


Rounds: TypeAlias = Generator[Round, Any, T]


@dataclass(frozen=True)
class Done(Generic[T]):
    """A flow of rounds that has returned its value."""

    value: T


def advance(flow: Rounds[T], replies: Any, error: BaseException | None) -> Round | Done[T]:
    """The next round of `flow` after `replies` (or with `error` thrown in), or its value.
    A driver throws what its I/O raised (a cancellation, Ctrl-C) so the flow cleans up."""
    try:
        return flow.send(replies) if error is None else flow.throw(error)
    except StopIteration as stop:
        return Done(stop.value)


def is_noscript(value: Any) -> bool:
    """A master that lost its scripts (SCRIPT FLUSH, a restart): load them and resend."""
    return isinstance(value, _ErrorReply) and value.startswith("NOSCRIPT")


@dataclass
class _Tally:
    """Phase one's replies, sorted by kind."""

    granted: dict[int, tuple[int, bool]]  # master -> (value, proposal accepted)
    busy: dict[int, list[Any]]
    done: dict[int, list[Any]]
    silent: list[int]  # no reply (down, broken, or still pending), or an error reply
    errors: list[str]  # the error replies among them


@dataclass
class _Attempt:
    """One grant attempt: who asks, its fence proposal, its validity, who answered last."""

    key: str
    owner: str
    proposal: int  # 0: none, the fence takes two phases
    retention: int  # ms a fence counter is kept
    valid_until: float  # the backend's clock
    deadline: float  # time.monotonic(): stop waiting for replies
    clock: Clock = SYSTEM_CLOCK
    # Masters that answered the last round: they owe nothing, so a release to them is
    # awaited; the others get it queued behind what they owe.
    answered: set[int] = field(default_factory=set)

    def valid(self) -> bool:
        return self.clock.monotonic() < self.valid_until

    def heard(self, replies: dict[int, Any]) -> None:
        for i, v in replies.items():
            if v is NO_REPLY:
                self.answered.discard(i)
            else:
                self.answered.add(i)


class RedlockBackend(LockBackend):
    """Locks on a majority of N independent Redis masters. Build with `from_url`.

    A grant takes the lock on every master in parallel and counts only with a majority
    and validity left (TTL - elapsed - drift, on the monotonic clock). Its fence is
    written, under the lock, on a majority: phase one asks every master for
    max(stored fence, server µs); phase two writes max + 1 where the stored fence is
    lower. The client proposes a fence with phase one (above its own clock and every fence
    it has seen); where every master that locked took the proposal, that was phase two
    and the grant is done in one round trip. See the README's "Lock backends" for what it
    guarantees and where it breaks.
    """

    name: ClassVar[str] = "redlock"
    # The fence is durable only where every master keeps its data through a crash (AOF,
    # appendfsync always): `check_servers` finds out and says so on this instance.
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=False, ha=True, release_notify=True
    )

    def __init__(
        self,
        urls: Sequence[str],
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = DEFAULT_FENCE_RETENTION,
        one_round: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(clock=clock)
        if len(urls) < 3 or len(urls) % 2 == 0:
            raise LockError(
                f"redlock needs an odd number of masters, at least 3; got {len(urls)} "
                "(JOBFENCE_LOCK_URL=redlock://host:port,host:port,host:port)"
            )
        self.keys = KeySpace(prefix)
        self.fence_retention_ms = int(fence_retention * 1000)
        self.socket_timeout = socket_timeout
        self.one_round = one_round
        sources = {name: script_source(name) for name in SCRIPTS}
        self.sha = {n: hashlib.sha1(s.encode()).hexdigest() for n, s in sources.items()}
        self.masters = [_Master(u, socket_timeout=socket_timeout, scripts=sources) for u in urls]
        self.quorum = len(self.masters) // 2 + 1
        self.fence_floor = 0  # the highest fence granted to this client, on any key
        self.rounds = 0  # parallel round trips made (each sends one command per master)
        self._max_block = max(0.01, 0.8 * socket_timeout)
        self._wait_on = 0  # the master waiters block on; moves on when it fails
        # key -> a master that refused this client's last attempt on it, and so marked the
        # lock waited on: its release signals there. The default master may have run the
        # attempt after the release, and never signal (CI once waited a release out).
        self._marked: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "jobfence",
        socket_timeout: float = 2.0,
        fence_retention: float = DEFAULT_FENCE_RETENTION,
        one_round: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> RedlockBackend:
        """`redlock://[user:password@]host:port,host:port,host:port[,...][/db]`."""
        return cls(
            redlock_masters(url),
            prefix=prefix,
            socket_timeout=socket_timeout,
            fence_retention=fence_retention,
            one_round=one_round,
            clock=clock,
        )

    @classmethod
    def from_settings(cls, settings: Settings, *, clock: Clock = SYSTEM_CLOCK) -> RedlockBackend:
        return cls.from_url(settings.lock_url, clock=clock, **settings_options(settings))

    # -- the parallel round trip ----------------------------------------------------
    def _checkout(self) -> list[_Link | None]:
        """One link per master for one operation; links whose master closed them are renewed."""
        pid = os.getpid()
        links = [m.checkout(pid) for m in self.masters]
        poller = select.poll()
        for link in links:
            if link is not None and not link.owed:
                poller.register(link.fd, select.POLLIN)
        # Something to read on a link that owes nothing: the master closed it (restart,
        # idle timeout) or it is out of step. Replace it now, before a command is lost.
        for fd, _ in poller.poll(0):
            i = next(j for j, lk in enumerate(links) if lk is not None and lk.fd == fd)
            stale = links[i]
            assert stale is not None
            if stale.tls and stale.recv() is None:
                continue  # a TLS message with no data for us (a session ticket): not stale
            stale.close()
            links[i] = None
            try:
                links[i] = self.masters[i].connect()
            except OSError:
                self.masters[i].down_until = time.monotonic() + RECONNECT_DELAY
        return links

    def _checkin(self, links: list[_Link | None]) -> None:
        pid = os.getpid()
        for master, link in zip(self.masters, links, strict=True):
            if link is not None:
                if link.owed > MAX_OWED:
                    link.close()
                else:
                    master.checkin(link, pid)

    def _run(self, flow: Rounds[T]) -> T:
        """Carry `flow`'s rounds on one link per master, in this thread."""
        links = self._checkout()
        try:
            replies: Any = None
            error: BaseException | None = None
            while not isinstance(step := advance(flow, replies, error), Done):
                replies = error = None
                try:
                    replies = self._round(links, step)
                except BaseException as exc:  # Ctrl-C: the flow frees what it may hold
                    error = exc
            return step.value
        finally:
            self._checkin(links)

    def _round(self, links: list[_Link | None], step: Round) -> dict[int, Any]:
        """Send the round's payload to every target master, then read replies until it is
        decided or its deadline. Returns a reply (or NO_REPLY) per target; masters still
        silent keep owing theirs on their link."""
        self.rounds += 1
        payload = step.payload
        replies: dict[int, Any] = {}
        waiting: dict[int, int] = {}  # fd -> master
        poller = select.poll()
        for i in range(len(links)) if step.targets is None else step.targets:
            link = links[i]
            if link is None or not link.send(payload):
                if link is not None:
                    self._drop(links, i)
                replies[i] = NO_REPLY
                continue
            waiting[link.fd] = i
            poller.register(link.fd, select.POLLIN)
        reloaded: set[int] = set()
        while waiting and not step.decided(replies, len(waiting)):
            left = step.deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                i = waiting[fd]
                value = self._read(links, i, payload, reloaded)
                if value is not _MORE:
                    replies[i] = value
                    del waiting[fd]
                    poller.unregister(fd)
        for i in waiting.values():
            replies[i] = NO_REPLY
        return replies

    def _read(
        self, links: list[_Link | None], i: int, payload: bytes, reloaded: set[int]
    ) -> Any:
        """What master `i`'s link has for us: the awaited reply, NO_REPLY if the link
        broke, or _MORE if it is still on its way (earlier replies are read and dropped)."""
        link = links[i]
        assert link is not None
        data = link.recv()
        if data is None:
            return _MORE
        if not data:  # closed or reset: whatever it owed is lost
            return self._drop(links, i)
        link.buf += data
        while link.owed:
            try:
                value = link.take()
            except ValueError:  # not RESP: the stream is out of step
                return self._drop(links, i)
            if value is _MORE or link.owed:  # incomplete, or a reply nobody waits for
                if value is _MORE:
                    return _MORE
                continue
            if not is_noscript(value) or i in reloaded:
                self.masters[i].last_error = None
                return value
            # The master lost its scripts (SCRIPT FLUSH): load them and resend, in order
            # on the same link.
            reloaded.add(i)
            loads = self.masters[i].script_loads()
            if not link.send(b"".join([*loads, payload])):
                return self._drop(links, i)
            link.owed += len(loads)  # one send, but a reply per command
        return _MORE

    def _drop(self, links: list[_Link | None], i: int) -> Any:
        link = links[i]
        if link is not None:
            if link.error is not None:  # why, for BackendUnavailable's hint
                self.masters[i].last_error = link.error
            link.close()
        links[i] = None
        return NO_REPLY

    def _evalsha(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> bytes:
        return _pack("EVALSHA", self.sha[script], len(keys), *keys, *args)

    def _io_deadline(self, started: float) -> float:
        return started + self.socket_timeout

    def _unavailable(
        self, what: str, replies: dict[int, Any], key: str | None
    ) -> BackendUnavailable:
        errors = [v for v in replies.values() if isinstance(v, _ErrorReply)]
        answered = sum(1 for v in replies.values() if v is not NO_REPLY)
        detail = f" (a master said: {errors[0]})" if errors else ""
        silent = [i for i, v in replies.items() if v is NO_REPLY]
        return BackendUnavailable(
            f"redlock {what}: {answered} of {len(self.masters)} masters answered, "
            f"a majority of {self.quorum} is needed{detail}{self._why(errors, silent)}",
            key=key,
        )

    def _why(self, errors: Sequence[str], silent: Sequence[int]) -> str:
        """'; <what to fix>' when the masters' error replies or the failed connections of
        the silent ones say (TLS, a login: waiting will not help), else ''."""
        causes = [*(Exception(e) for e in errors),
                  *(e for i in silent if (e := self.masters[i].last_error) is not None)]
        hint = next((h for c in causes if (h := tls_hint(c)) is not None), None)
        return f"; {hint}" if hint else ""

    def _count(self, replies: dict[int, Any], ok: Callable[[Any], bool]) -> tuple[int, int]:
        """(masters whose reply passes `ok`, masters that gave no usable reply)."""
        good = sum(1 for v in replies.values() if v is not NO_REPLY and ok(v))
        silent = sum(1 for v in replies.values() if v is NO_REPLY or isinstance(v, _ErrorReply))
        return good, silent

    def _everywhere(
        self, payload: bytes, *, ok: Callable[[Any], bool] | None = None
    ) -> Rounds[dict[int, Any]]:
        """One round to every master. With `ok`, stop once a majority passed it or cannot."""
        q, decided = self.quorum, _never
        if ok is not None:
            passes = ok

            def majority_told(replies: dict[int, Any], pending: int) -> bool:
                good = sum(1 for v in replies.values() if v is not NO_REPLY and passes(v))
                return good >= q or good + pending < q

            decided = majority_told
        replies: dict[int, Any] = yield Round(payload, self._io_deadline(time.monotonic()), decided)
        return replies

    def _majority(
        self, payload: bytes, key: str | None, what: str, ok: Callable[[Any], bool]
    ) -> Rounds[bool]:
        """True if a majority passed `ok`; raises BackendUnavailable if it cannot be told."""
        replies = yield from self._everywhere(payload, ok=ok)
        good, silent = self._count(replies, ok)
        if good >= self.quorum:
            return True
        if good + silent >= self.quorum:
            raise self._unavailable(what, replies, key)
        return False

    def _quorum_of(
        self, what: str, replies: dict[int, Any], key: str | None, usable: Callable[[Any], bool]
    ) -> list[Any]:
        """The replies that pass `usable`; BackendUnavailable unless a majority does."""
        answers = [v for v in replies.values() if usable(v)]
        if len(answers) < self.quorum:
            raise self._unavailable(what, replies, key)
        return answers

    # -- grants ---------------------------------------------------------------------
    def _begin(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> int | Busy | JobRecord:
        return self._run(self.begin_rounds(key, owner, ttl_ms, meta, record, fingerprint))

    def begin_rounds(
        self, key: str, owner: str, ttl_ms: int, meta: OwnerMeta, record: bool, fingerprint: str
    ) -> Rounds[int | Busy | JobRecord]:
        """A grant: the new fence, Busy, the job's record, or BackendUnavailable."""
        ttl = ttl_ms / 1000
        started = self.clock.monotonic()
        valid_until = started + ttl - (ttl * DRIFT_FRACTION + DRIFT_FLOOR)
        if valid_until <= started:
            raise LockError(
                f"ttl {ttl:g}s leaves no validity after the clock-drift allowance "
                f"(ttl x {DRIFT_FRACTION:g} + {DRIFT_FLOOR * 1000:g} ms); use a longer ttl",
                key=key,
            )
        proposal = 0
        if self.one_round:
            proposal = max(self.fence_floor + 1, time.time_ns() // 1000 + PROPOSAL_LEAD_US)
        retention = max(self.fence_retention_ms, ttl_ms)
        k = self.keys
        keys = [k.lock(key), k.fence(key)] + ([k.record(key)] if record else [])
        holder = f"{meta.host}\n{meta.pid}\n{meta.task_name}\n{meta.process_start}"
        payload = self._evalsha(
            "redlock_begin",
            keys,
            [owner, ttl_ms, retention, "1" if record else "0", meta.task_id, holder,
             fingerprint if record else "", proposal],
        )  # fmt: skip
        attempt = _Attempt(
            key=key,
            owner=owner,
            proposal=proposal,
            retention=retention,
            valid_until=valid_until,
            # Replies later than the validity are no use: stop waiting for them then.
            deadline=time.monotonic() + min(self.socket_timeout, ttl),
            clock=self.clock,
        )
        try:
            tally = yield from self._phase_one(attempt, payload)
            return (yield from self._settle(attempt, tally, ttl))
        except (Exception, GeneratorExit):
            raise  # decided here (released already), or a lost reply: lapses after its TTL
        except BaseException:
            # Cancelled or interrupted mid-grant: free the key on every master now, sent
            # behind the grant's commands on each connection (so it runs after them), not
            # waited for.
            yield self._release_round(attempt, None, 0.0)
            raise

    def _settle(
        self, attempt: _Attempt, tally: _Tally, ttl: float
    ) -> Rounds[int | Busy | JobRecord]:
        """Turn phase one's replies into a grant (after phase two if needed), the job's
        record, Busy, or BackendUnavailable; whatever is not a grant is released at once."""
        q, n = self.quorum, len(self.masters)
        ours = [*tally.granted, *tally.silent]  # masters that hold, or may hold, our key
        if len(tally.done) >= q:
            yield from self._release_on(attempt, ours)
            return _record(max(tally.done.values(), key=lambda r: int(r[4] or 0)))
        if len(tally.granted) >= q and attempt.valid():
            fence = yield from self._fence(attempt, tally)
            if fence is not None and attempt.valid():
                with self._lock:
                    self.fence_floor = max(self.fence_floor, fence)
                return fence
            yield from self._release_on(attempt, ours)
            raise BackendUnavailable(
                f"redlock grant not confirmed by a majority within its validity ({n} masters, "
                f"ttl {ttl:g}s)",
                key=attempt.key,
            )
        yield from self._release_on(attempt, ours)
        if tally.busy and len(tally.busy) + len(tally.done) > n - q:
            self._note_marked(attempt.key, tally)
            return self._busy(tally)
        if len(tally.granted) >= q:
            raise BackendUnavailable(
                f"redlock acquire took longer than the lease's validity (ttl {ttl:g}s)",
                key=attempt.key,
            )
        detail = f" (a master said: {tally.errors[0]})" if tally.errors else ""
        raise BackendUnavailable(
            f"redlock acquire: {n - len(tally.silent)} of {n} masters answered, a majority "
            f"of {q} is needed{detail}{self._why(tally.errors, tally.silent)}",
            key=attempt.key,
        )

    def _phase_one(self, attempt: _Attempt, payload: bytes) -> Rounds[_Tally]:
        q, n = self.quorum, len(self.masters)

        def decided(replies: dict[int, Any], pending: int) -> bool:
            # Done when a majority granted or has the record, or when refusals alone rule
            # a majority out. Masters that do not answer are waited for (up to the
            # deadline): the error then says how many answered, and the clean-up knows
            # which masters to wait for.
            granted = done = refused = 0
            for v in replies.values():
                if type(v) is list:
                    if v[0] == 1:
                        granted += 1
                    else:
                        refused += 1
                        done += v[0] == 2
            return granted >= q or done >= q or refused > n - q or pending == 0

        replies = yield Round(payload, attempt.deadline, decided)
        attempt.heard(replies)
        tally = _Tally({}, {}, {}, [], [])
        for i in range(n):
            v = replies.get(i, NO_REPLY)
            if type(v) is not list:
                tally.silent.append(i)
                if isinstance(v, _ErrorReply):
                    tally.errors.append(v)
            elif v[0] == 1:
                tally.granted[i] = (int(v[1]), bool(v[2]))
            elif v[0] == 0:
                tally.busy[i] = v
            else:
                tally.done[i] = v
        return tally

    def _fence(self, attempt: _Attempt, tally: _Tally) -> Rounds[int | None]:
        """The grant's fence once a majority carries it under our lock, else None."""
        proposal = attempt.proposal
        if proposal and all(accepted for _, accepted in tally.granted.values()):
            # Every master that locked took the proposal: phase two is done. A master that
            # has not answered yet will mostly take it too; if not, it holds our key without
            # the fence (never counted) until the release, queued behind on its connection.
            return proposal
        values = [value for value, _ in tally.granted.values()]
        fence = max([*values, proposal, self.fence_floor]) + 1
        k, key = self.keys, attempt.key
        payload = self._evalsha(
            "redlock_fence",
            [k.lock(key), k.fence(key), k.signal(key)],
            [attempt.owner, fence, attempt.retention, SIGNAL_LIFETIME_MS],
        )
        q = self.quorum

        def decided(replies: dict[int, Any], pending: int) -> bool:
            ok = sum(1 for v in replies.values() if v == 1)
            return ok >= q or ok + pending < q

        # Phase two goes to the silent masters too (queued behind phase one on their
        # connection): each ends in line with the grant, or without our key.
        targets = [*tally.granted, *tally.silent]
        replies = yield Round(payload, attempt.deadline, decided, targets)
        attempt.heard(replies)
        accepted = sum(1 for v in replies.values() if v == 1)
        return fence if accepted >= q else None

    def _release_on(self, attempt: _Attempt, masters: Sequence[int]) -> Rounds[None]:
        """Owner-checked release on `masters` at once; waits for those that answered the
        last round (the others get it queued behind what they owe)."""
        if masters:
            yield self._release_round(attempt, masters, self._io_deadline(time.monotonic()))

    def _release_round(
        self, attempt: _Attempt, masters: Sequence[int] | None, deadline: float
    ) -> Round:
        k, key = self.keys, attempt.key
        payload = self._evalsha(
            "release", [k.lock(key), k.signal(key)], [attempt.owner, SIGNAL_LIFETIME_MS]
        )
        live = attempt.answered.intersection(range(len(self.masters)) if masters is None
                                             else masters)  # fmt: skip

        def decided(replies: dict[int, Any], pending: int) -> bool:
            return live.issubset(replies)

        return Round(payload, deadline, decided, masters)

    def _note_marked(self, key: str, tally: _Tally) -> None:
        """Remember a master that refused `key` (so marked it waited on) for the wait."""
        default = self._wait_on % len(self.masters)
        index = default if default in tally.busy else next(iter(tally.busy))
        with self._lock:
            if len(self._marked) >= MARKED_KEYS_KEPT:  # refused, never waited (skip): forget
                self._marked.clear()
            self._marked[key] = index

    def wait_master(self, key: str) -> int:
        """The master a wait for `key`'s release blocks on: one that refused this client's
        last attempt (the release signals there), else the current default."""
        with self._lock:
            marked = self._marked.pop(key, None)
        return self._wait_on % len(self.masters) if marked is None else marked

    def _busy(self, tally: _Tally) -> Busy:
        # The holder's grant ends when enough of its masters expire for a majority to be
        # free: with `free` masters not held, that is the (quorum - free)-th expiry.
        free = len(self.masters) - len(tally.busy)
        ttls = sorted(
            float("inf") if int(v[1]) < 0 else int(v[1]) / 1000 for v in tally.busy.values()
        )
        nth = max(0, min(len(ttls) - 1, self.quorum - free - 1))
        (task_id, fingerprint), _ = Counter(
            (str(v[2] or ""), str(v[3] or "")) for v in tally.busy.values()
        ).most_common(1)[0]
        return Busy(ttl_left=ttls[nth], task_id=task_id, fingerprint=fingerprint)

    # -- keeping and ending grants ---------------------------------------------------
    def _extend(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self._run(self._extend_rounds(key, owner, ttl_ms))

    def _extend_rounds(self, key: str, owner: str, ttl_ms: int) -> Rounds[bool]:
        payload = self._evalsha("extend", [self.keys.lock(key)], [owner, ttl_ms])
        replies = yield from self._everywhere(payload, ok=lambda v: v == 1)
        extended, silent = self._count(replies, lambda v: v == 1)
        if extended >= self.quorum:
            return True
        if len(self.masters) - silent < self.quorum:  # as in extend_many_rounds
            raise self._unavailable("extend", replies, key)
        return False

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return self._run(self.extend_many_rounds(items))

    def extend_many_rounds(self, items: Sequence[tuple[str, str, int]]) -> Rounds[list[bool]]:
        """Extend every (key, owner, ttl ms) in one round; which a majority extended."""
        args: list[Any] = []
        for _, owner, ttl_ms in items:
            args += [owner, ttl_ms]
        payload = self._evalsha("extend_many", [self.keys.lock(k) for k, _, _ in items], args)
        q, n = self.quorum, len(items)

        def tallies(replies: dict[int, Any]) -> list[int]:
            counts = [0] * n
            for v in replies.values():
                if type(v) is list and len(v) == n:
                    for j, x in enumerate(v):
                        counts[j] += x == 1
            return counts

        def decided(replies: dict[int, Any], pending: int) -> bool:
            return all(c >= q or c + pending < q for c in tallies(replies))

        replies = yield Round(payload, self._io_deadline(time.monotonic()), decided)
        # A lease lives while a majority holds it. With a majority of masters answering, one
        # held on fewer is lost (the silent rest cannot be extended either); with fewer
        # answering nothing can be told, and the keeper tries again.
        self._quorum_of("extend_many", replies, None, _row_of(n))
        return [c >= q for c in tallies(replies)]

    def _release(self, key: str, owner: str) -> bool:
        return self._run(self.release_rounds(key, owner))

    def release_rounds(self, key: str, owner: str) -> Rounds[bool]:
        """Owner-checked release; True where a majority removed the key."""
        k = self.keys
        payload = self._evalsha(
            "release", [k.lock(key), k.signal(key)], [owner, SIGNAL_LIFETIME_MS]
        )
        return (yield from self._majority(payload, key, "release", lambda v: v == 1))

    def _commit(self, rec: CommitRecord) -> bool:
        return self._run(self.commit_rounds(rec))

    def commit_rounds(self, rec: CommitRecord) -> Rounds[bool]:
        """Store the record and release where the owner still holds; True on a majority."""
        key, owner, fence, state, result, fingerprint, result_ttl_ms = rec
        k = self.keys
        payload = self._evalsha(
            "redlock_commit",
            [k.lock(key), k.record(key), k.signal(key)],
            [owner, state, result, fingerprint, fence, result_ttl_ms, SIGNAL_LIFETIME_MS,
             time.time_ns() // 1_000_000],
        )  # fmt: skip
        return (yield from self._majority(payload, key, "commit", lambda v: v == 1))

    # -- reading --------------------------------------------------------------------
    def _inspect(self, key: str) -> LockInfo | None:
        return self._run(self.inspect_rounds(key))

    def inspect_rounds(self, key: str) -> Rounds[LockInfo | None]:
        """What a majority of masters shows of `key`'s holder (never the owner token)."""
        payload = self._evalsha("redlock_inspect", [self.keys.lock(key)], [])
        replies = yield from self._everywhere(payload)
        views = self._quorum_of("inspect", replies, key, _row_of(6))
        by_fence: dict[str, list[list[Any]]] = {}
        for v in views:
            if v[0] is not None and int(v[5]) != -2:
                by_fence.setdefault(str(v[0]), []).append(v)
        held = [group for group in by_fence.values() if len(group) >= self.quorum]
        if not held:
            return None
        group = held[0]
        fence = int(group[0][0])
        # The lock holds while a majority of its copies live: the quorum-th longest TTL.
        ttls = sorted((max(0, int(v[5])) for v in group), reverse=True)
        first = min(group, key=lambda v: int(v[3] or 0))
        host, pid, task_name, started = [*str(first[2]).split("\n", 3), "", "", ""][:4]
        acquired = min(int(v[3] or 0) for v in group)
        beat = max(int(v[4] or v[3] or 0) for v in group)
        return LockInfo(
            key=key,
            fence=fence,
            ttl_left=ttls[self.quorum - 1] / 1000,
            host=host,
            pid=int(pid or 0),
            task_id=str(first[1]),
            task_name=task_name,
            acquired_at=acquired / 1000,
            last_heartbeat=beat / 1000,
            process_start=started,
        )

    def scan(self, match: str = "*") -> Iterator[LockInfo]:
        names: set[str] = set()
        reached = 0
        for master in self.masters:
            try:
                names.update(
                    str(n)
                    for n in master.client.scan_iter(match=self.keys.lock_pattern(match), count=500)
                )
                reached += 1
            except RedisError:
                continue
        if reached < self.quorum:
            raise BackendUnavailable(
                f"redlock scan: {reached} of {len(self.masters)} masters answered, a majority "
                f"of {self.quorum} is needed"
            )
        for name in sorted(names):
            info = self._inspect(self.keys.key_of_lock(name))
            if info is not None:
                yield info

    def job_record(self, key: str) -> JobRecord | None:
        return self._run(self.job_record_rounds(key))

    def job_record_rounds(self, key: str) -> Rounds[JobRecord | None]:
        payload = _pack(
            "HMGET", self.keys.record(key), "state", "fingerprint", "result", "fence", "finished_ms"
        )
        replies = yield from self._everywhere(payload)
        rows = [tuple(v) for v in self._quorum_of("job_record", replies, key, _row_of(5))]
        for row, count in Counter(rows).most_common():
            if count >= self.quorum and row[0] in ("DONE", "FAILED"):
                return _record([2, *row])
        return None

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        return self._run(self.claim_publish_rounds(key, task_id, ttl))

    def claim_publish_rounds(self, key: str, task_id: str, ttl: float) -> Rounds[str | None]:
        """Claim `key`'s publish for `task_id`; the holder a majority names, if another."""
        payload = self._evalsha(
            "claim_publish", [self.keys.queued(key)], [task_id, int(ttl * 1000)]
        )
        replies = yield from self._everywhere(payload)
        answers = self._quorum_of("claim_publish", replies, key, _answer)
        held = Counter(str(v) for v in answers if v)
        if held:
            other, count = held.most_common(1)[0]
            if count >= self.quorum:
                return other
        return None

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        return self._run(self.swap_publish_rounds(key, expect, new, ttl_ms))

    def swap_publish_rounds(
        self, key: str, expect: str, new: str | None, ttl_ms: int
    ) -> Rounds[str | None]:
        """The swap on every master; done where a majority did it (a minority's swap
        expires with its TTL), else the value most of the refusing masters hold answers."""
        payload = self._evalsha(
            "swap_publish", [self.keys.queued(key)], [expect, new or "", ttl_ms]
        )
        replies = yield from self._everywhere(payload)
        answers = self._quorum_of("swap_publish", replies, key, _answer)
        kept = Counter(str(v) for v in answers if v)
        if len(answers) - sum(kept.values()) >= self.quorum:
            return None
        return kept.most_common(1)[0][0]

    def clear_publish(self, key: str) -> None:
        self._run(self.clear_publish_rounds(key))

    def clear_publish_rounds(self, key: str) -> Rounds[None]:
        payload = self._evalsha("redlock_admin", [self.keys.queued(key)], ["delete"])
        yield from self._majority(payload, key, "clear_publish", lambda v: isinstance(v, int))

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        return self._run(self.count_delivery_rounds(key, window_ms))

    def count_delivery_rounds(self, key: str, window_ms: int) -> Rounds[int]:
        payload = self._evalsha("redlock_admin", [self.keys.deliveries(key)], ["count", window_ms])
        replies = yield from self._everywhere(payload)
        counts = self._quorum_of("count_delivery", replies, key, lambda v: type(v) is int)
        return int(max(counts))  # a master that lost its count must not reset the cap

    def forget(self, key: str) -> bool:
        payload = self._evalsha("redlock_admin", [self.keys.record(key)], ["delete"])
        return self._any(payload, key, "forget")

    def force_release(self, key: str) -> bool:
        k = self.keys
        payload = self._evalsha(
            "redlock_admin", [k.lock(key), k.signal(key)], ["unlock", SIGNAL_LIFETIME_MS]
        )
        return self._any(payload, key, "force_release")

    def release_grant(self, key: str, fence: int) -> bool:
        """Remove `key`'s lock on every master where it still carries `fence`, in the same
        script that checks it: a grant made since the operator looked is left alone."""
        validate_key(key)
        k = self.keys
        payload = self._evalsha(
            "redlock_admin", [k.lock(key), k.signal(key)], ["judged", SIGNAL_LIFETIME_MS, fence]
        )
        return self._any(payload, key, "release_grant")

    def _any(self, payload: bytes, key: str, what: str) -> bool:
        """Sent to every master; True if any had the key. Raises without a majority."""
        replies = self._run(self._everywhere(payload))
        return any(self._quorum_of(what, replies, key, lambda v: type(v) is int))

    # -- waiting, time, servers -------------------------------------------------------
    def wait_for_release(self, key: str, timeout: float) -> None:
        """Block on one master's signal list until a release pushes it, or `timeout`.

        A release signals on every master where the refused attempt marked the lock as
        waited on; the waiter listens on one of those (`wait_master`). If that master fails,
        the next one is used from the next wait on, and this wait sleeps instead (the
        caller's backoff polls).
        """
        timeout = min(timeout, self._max_block)
        if timeout < 0.001:
            return
        index = self.wait_master(key)
        try:
            self.masters[index].client.blpop([self.keys.signal(key)], timeout=timeout)
        except RedisError:
            self._wait_on = index + 1
            self.clock.sleep(timeout)

    def server_time(self) -> float:
        for master in self.masters:
            try:
                seconds, micros = master.client.time()
            except RedisError:
                continue
            return float(seconds) + float(micros) / 1e6
        raise BackendUnavailable("redlock: no master answered TIME")

    def _ping(self) -> str:
        """PING each master: healthy while a majority answers (grants need one)."""
        answered = 0
        hint = None
        for master in self.masters:
            try:
                answered += bool(master.client.ping())
            except RedisError as exc:
                hint = hint or tls_hint(exc)
        detail = f"{answered} of {len(self.masters)} masters answered"
        if answered < self.quorum:
            raise BackendUnavailable(f"{detail}; a majority of {self.quorum} is needed"
                                     + (f"; {hint}" if hint else ""))  # fmt: skip
        return detail

    def security(self) -> Security:
        """TLS and login as configured, the weakest master's: TLS only if every master's
        sockets are wrapped, auth only if every master gets a password or certificate."""
        each = [security(m.tls, password=bool(m.password)) for m in self.masters]
        return Security(
            tls=all(s.tls for s in each),
            verified=all(s.verified for s in each),
            hostname_checked=all(s.hostname_checked for s in each),
            auth=all(s.auth for s in each),
        )

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        # Per master: refuse eviction; warn when one is down or keeps no crash-proof AOF
        # (its fence is then not durable, and the backend's capabilities say so).
        for refuse, problem, fix in self.check_servers():
            yield Finding(refuse, target.setting, problem, fix)

    def check_servers(self) -> list[tuple[bool, str, str]]:
        """What about the masters is unsafe (refuse) or weakens a guarantee (warn).

        Returns (refuse, problem, fix) triples, for the start-up checks. Also sets this
        instance's `capabilities.durable_fence`: true only when every master answered and
        keeps its data through a crash (appendonly yes, appendfsync always).
        """
        found: list[tuple[bool, str, str]] = []
        durable = 0
        for master in self.masters:
            try:
                conf = master.client.config_get("maxmemory-policy")
                conf.update(master.client.config_get("append*"))
            except ResponseError as exc:
                found.append((False, f"cannot read the settings of redlock master {master.name} "
                              f"({exc}; CONFIG is disabled or not permitted): its eviction "
                              "policy and persistence are unchecked",
                              "make sure it runs with maxmemory-policy noeviction, appendonly "
                              "yes and appendfsync always"))  # fmt: skip
                continue
            except RedisError as exc:
                found.append((tls_hint(exc) is not None,  # TLS or login: no outage
                              f"redlock master {master.name} does not answer "
                              f"({type(exc).__name__}: {exc})" + ("" if tls_hint(exc) else
                              f"; grants go on while a majority of {self.quorum} answers"),
                              tls_hint(exc)
                              or "start it, or fix the URL if it is wrong"))  # fmt: skip
                continue
            policy = conf.get("maxmemory-policy", "")
            if policy != "noeviction":
                found.append((True, f"redlock master {master.name} has maxmemory-policy "
                              f"{policy!r}: under memory pressure it may evict lock, fence "
                              "and job-record keys",
                              "run every master with --maxmemory-policy noeviction"))  # fmt: skip
            if conf.get("appendonly") == "yes" and conf.get("appendfsync") == "always":
                durable += 1
            else:
                found.append((False, f"redlock master {master.name} runs appendonly "
                              f"{conf.get('appendonly')!r}, appendfsync "
                              f"{conf.get('appendfsync')!r}: after a crash it comes back "
                              "without the fences it had, and the fence then rests on the "
                              "server clocks (skew between masters below the time between "
                              "two grants of a key) and on each client's own floor",
                              "run every master with appendonly yes and appendfsync always, "
                              "or restart a crashed master only after the longest TTL has "
                              "passed"))  # fmt: skip
        caps = replace(type(self).capabilities, durable_fence=durable == len(self.masters))
        vars(self)["capabilities"] = caps  # this instance's servers, not the class's default
        return found

    def close(self) -> None:
        """Wait briefly for replies still owed (so what was sent has run), then disconnect."""
        deadline = time.monotonic() + min(self.socket_timeout, 1.0)
        for master in self.masters:
            master.close(deadline)


def _row_of(n: int) -> Callable[[Any], bool]:
    """A master's reply that is a list of `n` values (a script's or HMGET's row)."""
    return lambda v: type(v) is list and len(v) == n


def _answer(value: Any) -> bool:
    """A master's usable answer: neither silence nor an error reply."""
    return value is not NO_REPLY and type(value) is not _ErrorReply


def _record(reply: list[Any]) -> JobRecord:
    _, state, fingerprint, result, fence, finished_ms = (str(x or "") for x in reply)
    return JobRecord(
        state=state,
        fingerprint=fingerprint,
        result=result,
        fence=int(fence or 0),
        finished_at=int(finished_ms or 0) / 1000,
    )
