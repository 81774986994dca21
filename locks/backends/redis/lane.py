"""The lane: a Redis pool's connections kept apart for the hot path's one-script calls."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from redis.connection import Connection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_pack_big: Callable[[tuple[Any, ...]], bytes] | None
try:  # a core dependency; packs any command at a third of the cost of the Python packer
    from hiredis import pack_command as _pack_big
except ImportError:  # pragma: no cover
    _pack_big = None


class Lane:
    """Connections kept out of the client's pool for the one-script calls on the hot path.

    redis-py checks a connection out of its pool for every command (a lock, and a peek at
    the socket to make sure it is clean) and back in afterwards; that costs more than the
    round trip itself on a loopback server. A lane keeps its own idle connections instead:
    made by the pool (same options: timeouts, TLS, auth), used by one thread at a time,
    checked before each use as the pool would, reconnected if an error closed them
    (redis-py disconnects on any error but an error reply), never retried after a command
    went out, and forgotten after a fork (the parent's sockets are not the child's).
    """

    def __init__(self, pool: ConnectionPool, node: str | None = None) -> None:
        self.pool = pool
        self.node = node  # the cluster node's name, where the lane serves one
        self.pid = os.getpid()
        self.idle: list[Connection] = []
        self.encoder = pool.get_encoder()
        # hiredis packs str as strict UTF-8, int and float as redis-py does (the same bytes)
        # at a third of the Python packer's cost (one pack per script call on the hot path);
        # a pool with another text encoding keeps the Python packer.
        utf8 = self.encoder.encoding.lower().replace("_", "-") in ("utf-8", "utf8")
        if _pack_big is not None and utf8 and self.encoder.encoding_errors == "strict":
            self.pack: Callable[[tuple[Any, ...]], bytes] = _pack_big
        else:
            self.pack = self.pack_py
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (lane := ref()) and lane._forked())  # type: ignore[func-returns-value]

    def _forked(self) -> None:
        # redis-py resets its pool in a child under the pool's own locks, which a thread of the
        # parent may have held at the fork (making a connection for the keeper or the decision
        # log's writer): the child's first command would wait for ever. Nothing of the child
        # holds them yet.
        self.pid, self.idle = os.getpid(), []
        for name in ("_fork_lock", "_lock"):
            if hasattr(self.pool, name):
                setattr(self.pool, name, threading.RLock())

    def pack_py(self, args: tuple[Any, ...]) -> bytes:
        """The command as RESP bytes: what redis-py's packer sends, at a third of its cost."""
        enc = self.encoder
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            kind = type(arg)
            if kind is str:
                data = arg.encode(enc.encoding, enc.encoding_errors)
            elif kind is int:
                data = b"%d" % arg
            else:  # bytes, float; refuses what redis-py refuses
                data = enc.encode(arg)  # type: ignore[no-untyped-call]
            parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
        return b"".join(parts)

    def _take(self) -> Connection:
        if self.pid != os.getpid():
            self.pid, self.idle = os.getpid(), []
        try:
            conn = self.idle.pop()  # atomic: no two threads get the same connection
        except IndexError:
            return self.pool.get_connection()
        # As the pool does before lending one: a connection with something to read was
        # closed by the server (restart, idle timeout) or holds a stray reply; reconnect it
        # now, before sending, rather than fail a command the server never saw.
        try:
            stale = conn.can_read(timeout=0)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            stale = True
        if stale:
            conn.disconnect()  # type: ignore[no-untyped-call]
        return conn

    def call(self, *args: Any) -> Any:
        conn = self._take()
        try:
            conn.send_packed_command([self.pack(args)])  # type: ignore[no-untyped-call]
            return conn.read_response()
        finally:
            self.idle.append(conn)

    def blpop(self, name: str, block: float, late: float) -> Any:
        """BLPOP `name` for up to `block` seconds, its reply awaited up to `late` seconds past
        the block instead of the socket timeout alone: Redis answers a timed-out BLPOP on
        its next event-loop tick (up to 100 ms late at the default hz), later on a loaded
        host, and a blocked read that outlives the socket timeout is not a dead server."""
        conn = self._take()
        try:
            conn.send_packed_command([self.pack(("BLPOP", name, block))])  # type: ignore[no-untyped-call]
            if not conn.can_read(timeout=block + late):
                conn.disconnect()  # type: ignore[no-untyped-call]
                raise RedisTimeoutError(f"no reply {block + late:g}s after a {block:g}s BLPOP")
            return conn.read_response()
        finally:
            self.idle.append(conn)

    def call_many(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Several commands in one write and their replies in one read: one round trip.
        Every reply is read before an error reply is raised (the first), so the connection
        stays clean."""
        conn = self._take()
        try:
            pack = self.pack
            conn.send_packed_command([pack(c) for c in commands])  # type: ignore[no-untyped-call]
            replies: list[Any] = []
            error: ResponseError | None = None
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    error = error or exc
                    replies.append(exc)
            if error is not None:
                raise error
            return replies
        finally:
            self.idle.append(conn)

    def close(self) -> None:
        idle, self.idle = self.idle, []
        if self.pid == os.getpid():
            for conn in idle:
                self.pool.release(conn)
