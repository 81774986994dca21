"""Waiting for a release on redis.asyncio: a BLPOP on the key's signal list, bounded so the
waiters never take every connection (the one-node, Sentinel, Cluster and Redlock stores)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis

from jobfence.locks.backends.redis.protocol import BLPOP_LATE


class SignalWait:
    """Waiting for a release on redis.asyncio: BLPOP on the key's signal list, shorter than
    the socket timeout (a blocked read must not look like a dead server). A BLPOP holds a
    connection: past half the pool the other waiters sleep out their backoff instead, so
    acquires and releases always find a connection."""

    def __init__(self, max_connections: int, socket_timeout: float | None) -> None:
        self.blocking = 0  # waiters in BLPOP now
        self.max_blocking = max(1, max_connections // 2)
        self.max_block = max(0.01, 0.8 * socket_timeout) if socket_timeout else 5.0
        # How late past its block a BLPOP's reply may come (BLPOP_LATE): on a connection of
        # our own the read waits that long past the block; through a client that reads
        # with its socket timeout alone (a cluster's), the block is half that timeout.
        self.late = (socket_timeout or 2.0) + BLPOP_LATE
        self.fit_block = max(0.01, min(self.max_block, 0.5 * (socket_timeout or 2.0)))

    async def wait(self, client: Any, signal: str, timeout: float) -> None:
        """Up to `timeout` seconds, or until a release pushes `signal`; RedisError as is."""
        timeout = min(timeout, self.max_block)
        if timeout < 0.001:
            return
        if self.blocking >= self.max_blocking:
            await asyncio.sleep(timeout)
            return
        self.blocking += 1
        try:
            pool = getattr(client, "connection_pool", None)
            if pool is None:
                # The block ends at half the client's read timeout: a timeout is its reply,
                # not the server, come late (a loaded machine; the client drops that
                # connection). The attempt that follows judges the server.
                with contextlib.suppress(redis.exceptions.TimeoutError):
                    await client.blpop([signal], timeout=min(timeout, self.fit_block))
                return
            conn = await pool.get_connection()
            try:
                await conn.send_command("BLPOP", signal, timeout)
                await conn.read_response(timeout=timeout + self.late)
            finally:
                await pool.release(conn)
        finally:
            self.blocking -= 1
