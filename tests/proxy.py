"""A fault-injecting TCP proxy for Redis: drop, delay or cut replies the server already sent.

The proxy sits between clients and a redis-server on a free local port. It parses both
RESP streams, so it knows which reply answers which command: a rule such as "drop the reply
to the next EVALSHA of the acquire script" fires only once the server has executed that
command and answered it, which is the fault a client cannot tell from a lost request.

    with FaultProxy(server.host, server.port) as proxy:
        rule = proxy.drop_reply(match=evalsha(sha))
        client = redis.Redis(port=proxy.port, socket_timeout=0.3)
        ...                            # the EVALSHA times out; the server did run it
        rule.fired.wait(5)

`cut()` stops all traffic both ways, as a partition would (bytes already sent are held, not
lost, like TCP retransmissions; new connections wait); `restore()` lets it flow again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.servers import HOST

Command = list[bytes]  # a parsed command: name and arguments, as sent
Matcher = Callable[[Command], bool]
Action = Literal["pass", "drop", "delay", "reset"]

_CHUNK = 65536


def command(name: str, *args: str | bytes) -> Matcher:
    """Match a command by name (any case) and, optionally, its first arguments."""
    want = [name.upper().encode()] + [a.encode() if isinstance(a, str) else a for a in args]

    def match(cmd: Command) -> bool:
        if len(cmd) < len(want) or cmd[0].upper() != want[0]:
            return False
        return all(got == w for got, w in zip(cmd[1:], want[1:], strict=False))

    return match


def evalsha(sha: str) -> Matcher:
    """Match EVALSHA of one script (e.g. ``backend.scripts["begin"].sha``)."""
    return command("EVALSHA", sha)


def any_command(cmd: Command) -> bool:
    return True


@dataclass(eq=False)
class ReplyRule:
    """What to do with the replies to matching commands, for the next `times` of them."""

    match: Matcher
    action: Action
    delay: float = 0.0
    times: int = 1
    errors: bool = False  # act on error replies too (by default they pass, uncounted)
    then: Callable[[], None] | None = None  # drop: run once the reply is swallowed
    fired: threading.Event = field(default_factory=threading.Event)
    count: int = 0  # how many replies it has acted on


class _Incomplete(Exception):
    """The buffer ends inside a RESP frame: read more."""


def _line(buf: bytes | bytearray, pos: int) -> tuple[bytes, int]:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    return bytes(buf[pos:end]), end + 2


def _frame_end(buf: bytes | bytearray, pos: int) -> int:
    """End offset of the RESP2/RESP3 frame starting at `pos` (raises _Incomplete)."""
    if pos >= len(buf):
        raise _Incomplete
    kind = buf[pos : pos + 1]
    head, nxt = _line(buf, pos + 1)
    if kind in (b"+", b"-", b":", b"_", b",", b"#", b"("):
        return nxt
    if kind in (b"$", b"!", b"="):
        size = int(head)
        if size < 0:
            return nxt
        if len(buf) < nxt + size + 2:
            raise _Incomplete
        return nxt + size + 2
    if kind in (b"*", b"~", b">", b"%", b"|"):
        count = int(head)
        if kind in (b"%", b"|"):
            count *= 2
        for _ in range(max(count, 0)):
            nxt = _frame_end(buf, nxt)
        return nxt
    # An inline command (client side only): one line.
    return nxt


def _split_frames(buf: bytes | bytearray) -> tuple[list[bytes], int]:
    """The complete RESP frames at the start of `buf`, and the offset where they end."""
    frames: list[bytes] = []
    pos = 0
    while True:
        try:
            end = _frame_end(buf, pos)
        except _Incomplete:
            return frames, pos
        frames.append(bytes(buf[pos:end]))
        pos = end


def _parse_command(frame: bytes) -> Command:
    if not frame.startswith(b"*"):
        return frame.strip().split()
    parts: Command = []
    count_line, pos = _line(frame, 1)
    for _ in range(int(count_line)):
        size_line, pos = _line(frame, pos + 1)
        size = int(size_line)
        parts.append(frame[pos : pos + size])
        pos += size + 2
    return parts


class _Link:
    """One client connection and its upstream connection, pumped by two threads."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.pending: deque[ReplyRule | None] = deque()  # one entry per command sent
        self.pending_lock = threading.Lock()
        self.closed = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="fault-proxy-link", daemon=True).start()

    def _run(self) -> None:
        proxy = self.proxy
        try:
            proxy.wait_open(self.closed)  # a cut holds new connections too
            if self.closed.is_set():
                return
            self.upstream = socket.create_connection(proxy.upstream, timeout=10)
            self.upstream.settimeout(None)
        except OSError:
            self.close()
            return
        threading.Thread(target=self._replies, name="fault-proxy-replies", daemon=True).start()
        self._commands()

    def _commands(self) -> None:
        """Client to server: note a rule (or none) per complete command, then forward."""
        buf = bytearray()
        assert self.upstream is not None
        try:
            while True:
                data = self.client.recv(_CHUNK)
                if not data:
                    break
                buf += data
                frames, pos = _split_frames(buf)
                for frame in frames:
                    with self.pending_lock:
                        self.pending.append(self.proxy._rule_for(_parse_command(frame)))
                del buf[:pos]
                self.proxy.wait_open(self.closed)
                if self.closed.is_set():
                    return
                self.upstream.sendall(data)  # the whole chunk: a split command's head too
            self.proxy.wait_open(self.closed)
            with contextlib.suppress(OSError):
                self.upstream.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()

    def _replies(self) -> None:
        """Server to client: act on each complete reply as its command's rule says."""
        buf = bytearray()
        assert self.upstream is not None
        try:
            while True:
                data = self.upstream.recv(_CHUNK)
                if not data:
                    break
                buf += data
                out = bytearray()
                replies, pos = _split_frames(buf)
                for reply in replies:
                    if reply.startswith(b">"):  # RESP3 push: answers no command
                        out += reply
                        continue
                    with self.pending_lock:
                        rule = self.pending.popleft() if self.pending else None
                    if rule is None:
                        out += reply
                        continue
                    if reply.startswith((b"-", b"!")) and not rule.errors:
                        # An error reply (NOSCRIPT, say): the command did nothing, so it
                        # is not the fault asked for. Pass it on; the rule waits for the next.
                        self.proxy._give_back(rule)
                        out += reply
                        continue
                    if rule.action == "drop":
                        if rule.then is not None:
                            rule.then()
                    elif rule.action == "delay":
                        self._send(out)
                        out.clear()
                        rule.fired.set()  # the server has answered: the fault is under way
                        time.sleep(rule.delay)
                        out += reply
                    elif rule.action == "reset":
                        self._send(out)
                        rule.fired.set()
                        self.close(reset=True)
                        return
                    rule.fired.set()
                del buf[:pos]
                self._send(out)
        except OSError:
            pass
        self.close()

    def _send(self, data: bytes | bytearray) -> None:
        if not data:
            return
        self.proxy.wait_open(self.closed)
        if not self.closed.is_set():
            self.client.sendall(data)

    def close(self, *, reset: bool = False) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if reset:  # RST, not FIN: the client sees "connection reset"
            with contextlib.suppress(OSError):
                self.client.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
        self.proxy._forget(self)


class FaultProxy:
    """A TCP proxy on a free port of 127.0.0.1 in front of ``upstream_host:upstream_port``.

    Rules act on replies, in the order they were added; the first rule that matches a
    command and still has uses left decides what happens to that command's reply:
    `drop_reply` swallows it (the client times out; the connection stays open),
    `delay_reply` holds it, `reset_after_reply` closes the client's connection with a RST
    instead of answering. Every rule's `fired` event is set once it acted.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = HOST) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self._listener: socket.socket | None = None
        self._rules: list[ReplyRule] = []
        self._mutex = threading.Lock()
        self._links: set[_Link] = set()
        self._open = threading.Event()
        self._open.set()
        self._stopped = threading.Event()
        self.commands_seen: list[bytes] = []  # command names, in the order they passed

    # -- lifecycle -----------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("FaultProxy has not been started")
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis.Redis through the proxy that tries each command once (redis-py's default
        re-sends a command after a timeout, which would hide or double a fault); keyword
        arguments are passed through. The caller closes it."""
        options: dict[str, Any] = {"socket_timeout": 5.0, "retry": Retry(NoBackoff(), 0)}
        options.update(kwargs)
        return redis.Redis(host=self.host, port=self.port, **options)

    def start(self) -> Self:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name="fault-proxy-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        self._stopped.set()
        self._open.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        with self._mutex:
            links = list(self._links)
        for link in links:
            link.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(self, client)
            with self._mutex:
                self._links.add(link)
            link.start()

    def _forget(self, link: _Link) -> None:
        with self._mutex:
            self._links.discard(link)

    # -- rules -----------------------------------------------------------------------
    def _add(self, rule: ReplyRule) -> ReplyRule:
        if rule.times < 1:
            raise ValueError(f"times must be >= 1, got {rule.times}")
        with self._mutex:
            self._rules.append(rule)
        return rule

    def drop_reply(
        self,
        *,
        match: Matcher = any_command,
        times: int = 1,
        then: Callable[[], None] | None = None,
    ) -> ReplyRule:
        """Swallow the replies to the next `times` matching commands (run by the server).

        `then`, if given, runs as each reply is swallowed, before `fired` is set and before
        the connection's later replies pass: another client's write lands between the lost
        reply and the client's resend."""
        return self._add(ReplyRule(match, "drop", times=times, then=then))

    def delay_reply(
        self, seconds: float, *, match: Matcher = any_command, times: int = 1
    ) -> ReplyRule:
        """Hold the replies to the next `times` matching commands for `seconds` each."""
        return self._add(ReplyRule(match, "delay", delay=seconds, times=times))

    def reset_after_reply(self, *, match: Matcher = any_command, times: int = 1) -> ReplyRule:
        """Reset the client's connection instead of sending the reply (the server ran it)."""
        return self._add(ReplyRule(match, "reset", times=times))

    def clear_rules(self) -> None:
        with self._mutex:
            self._rules.clear()

    def _give_back(self, rule: ReplyRule) -> None:
        with self._mutex:
            rule.count -= 1

    def _rule_for(self, cmd: Command) -> ReplyRule | None:
        with self._mutex:
            if cmd:
                self.commands_seen.append(cmd[0].upper())
            for rule in self._rules:
                if rule.count < rule.times and rule.match(cmd):
                    rule.count += 1
                    return rule
        return None

    # -- partition ---------------------------------------------------------------------
    def cut(self) -> None:
        """Stop all traffic both ways; held bytes flow again on `restore()`."""
        self._open.clear()

    def restore(self) -> None:
        self._open.set()

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def wait_open(self, closed: threading.Event) -> None:
        while not self._open.wait(0.05):
            if closed.is_set() or self._stopped.is_set():
                return

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[None]:
        """Cut inside the block, restored on exit (even on error)."""
        self.cut()
        try:
            yield
        finally:
            self.restore()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def matching(names: Sequence[str]) -> Matcher:
    """Match any command whose name is one of `names` (any case)."""
    wanted = {n.upper().encode() for n in names}
    return lambda cmd: bool(cmd) and cmd[0].upper() in wanted
