"""A Redis Cluster's heartbeats: one script per node for all the leases it serves, all nodes
at once; a node that fails leaves only its own leases unknown."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from jobfence.locks.backend import validate_ttl
from jobfence.locks.backends.redis.cluster_nodes import extend_args, group_by_node
from jobfence.locks.backends.redis.protocol import EXTEND_CHUNK
from jobfence.locks.clock import Clock
from jobfence.locks.errors import BackendUnavailable, NotOwner
from jobfence.locks.keys import KeySpace
from jobfence.locks.lease import Lease
from jobfence.locks.slots import SlotLease


class NodeHeartbeats:
    """The heartbeat half of RedisClusterBackend (mixed in before RedisBackend, whose
    `extend_many`, `_extend_many` and `_sem_extend_many` it replaces)."""

    cluster: Any
    keys: KeySpace
    clock: Clock
    semaphore_retention_ms: int
    extend_sha: str  # cluster_extend_many.lua's digest and source
    extend_source: str

    if TYPE_CHECKING:  # RedisBackend's, after this class in the MRO

        def _call(self, name: str, keys: list[str], args: list[Any], key: str | None) -> Any: ...

        def _sem_script(
            self, name: str, keys: list[str], args: list[Any], key: str | None
        ) -> Any: ...

        def _sem_keys(self, key: str) -> list[str]: ...

    def extend_many(self, leases: Sequence[Lease]) -> list[bool]:
        """As the base, but a node that did not answer leaves only its own leases unknown:
        the others are renewed or marked lost first, then BackendUnavailable is raised (the
        keeper retries the batch soon). Semaphore slots go in their node's script too, so
        a hung master delays neither another's locks nor its slots."""
        if not leases:
            return []
        started = self.clock.monotonic()
        items = [(le.key, le.owner, validate_ttl(le.ttl)) for le in leases]
        results, failure = self._extend_per_node(items, [type(le) is SlotLease for le in leases])
        for lease, ok in zip(leases, results, strict=True):
            if ok is True:
                lease.renewed(started)
            elif ok is False:
                lease.mark_lost(
                    NotOwner("extend refused: not the owner", key=lease.key, fence=lease.fence)
                )
        if failure is not None:
            raise failure
        return [bool(ok) for ok in results]

    def _extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        results, failure = self._extend_per_node(items, [False] * len(items))
        if failure is not None:
            raise failure
        return [bool(ok) for ok in results]

    def _sem_extend_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        results, failure = self._extend_per_node(items, [True] * len(items))
        if failure is not None:
            raise failure
        return [bool(ok) for ok in results]

    def _extend_per_node(
        self, items: Sequence[tuple[str, str, int]], slots: Sequence[bool]
    ) -> tuple[list[bool | None], BackendUnavailable | None]:
        """Each lease's answer (None: unknown), and the error that left some unknown.
        `slots[i]`: item i is a semaphore slot, not a lock."""
        groups, retry = group_by_node(self.keys, items, slots, self.cluster.keyslot,
                                      self.cluster.nodes_manager.get_node_from_slot)  # fmt: skip
        results: list[bool | None] = [None] * len(items)
        # A node that failed (refused, timed out): its leases stay unknown this batch, and
        # are not sent again one by one, which would cost a timeout each on a hung node.
        failed: list[tuple[str, BaseException]] = []
        sent = self._send_per_node(groups.values(), items, slots, failed)
        for node, pool, conn, chunks in sent:  # every node works on its batch meanwhile
            try:
                replies = self._read_extend(conn, chunks, items, slots)
            except RedisError as exc:
                conn.disconnect()  # type: ignore[no-untyped-call]
                failed.append((node.name, exc))
                continue
            finally:
                pool.release(conn)
            for chunk, reply in zip(chunks, replies, strict=True):
                for i, answer in zip(chunk, reply, strict=True):
                    if int(answer) < 0:  # the slot moved away from this node
                        retry.append(i)
                    else:
                        results[i] = bool(int(answer))
        failure = self._forget_failed_nodes(failed)
        moved = self._extend_moved(sorted(retry), items, slots, results)
        return results, failure or moved

    def _send_per_node(
        self,
        groups: Iterable[tuple[Any, list[int]]],
        items: Sequence[tuple[str, str, int]],
        slots: Sequence[bool],
        failed: list[tuple[str, BaseException]],
    ) -> list[tuple[Any, Any, Any, list[list[int]]]]:
        """Write each node's scripts (EXTEND_CHUNK leases each) on a connection of its own,
        all in one write per node, replies unread: (node, pool, connection, chunks) each.
        A node that cannot be written to goes to `failed`."""
        sent: list[tuple[Any, Any, Any, list[list[int]]]] = []
        for node, indexes in groups:
            # One round trip per node, and the node serves other clients between the scripts.
            chunks = [indexes[i : i + EXTEND_CHUNK] for i in range(0, len(indexes), EXTEND_CHUNK)]
            try:
                pool = self.cluster.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
            except (RedisError, RedisClusterException) as exc:
                failed.append((node.name, exc))
                continue
            try:
                conn.send_packed_command(
                    conn.pack_commands([self._extend_command(c, items, slots) for c in chunks])
                )
            except RedisError as exc:
                conn.disconnect()  # type: ignore[no-untyped-call]
                pool.release(conn)
                failed.append((node.name, exc))
                continue
            sent.append((node, pool, conn, chunks))
        return sent

    def _forget_failed_nodes(
        self, failed: list[tuple[str, BaseException]]
    ) -> BackendUnavailable | None:
        """The error of the first failed node; the map read again for each (the failed node
        asked last), so that the next batch finds a replica promoted in its place."""
        failure: BackendUnavailable | None = None
        for name, cause in failed:
            failure = failure or BackendUnavailable(
                f"redis cluster extend_many failed on node {name}", cause=cause
            )
            with contextlib.suppress(RedisError, RedisClusterException):
                self.cluster.nodes_manager.initialize(last_failed_node_name=name)
        return failure

    def _extend_moved(
        self,
        indexes: list[int],
        items: Sequence[tuple[str, str, int]],
        slots: Sequence[bool],
        results: list[bool | None],
    ) -> BackendUnavailable | None:
        """Extend the leases at `indexes` one by one through the cluster client (it follows
        MOVED/ASK): slots that moved, or that no node served; the first error, if any."""
        failure: BackendUnavailable | None = None
        for i in indexes:
            key, owner, ttl_ms = items[i]
            try:
                if slots[i]:
                    args = [self.semaphore_retention_ms, owner, ttl_ms]
                    reply = self._sem_script("sem_extend_many", self._sem_keys(key), args, key)
                    results[i] = bool(int(reply[0]))
                else:
                    results[i] = bool(
                        self._call("extend", [self.keys.lock(key)], [owner, ttl_ms], key)
                    )
            except BackendUnavailable as exc:
                failure = failure or exc
        return failure

    def _extend_command(
        self, indexes: list[int], items: Sequence[tuple[str, str, int]], slots: Sequence[bool]
    ) -> tuple[Any, ...]:
        args = extend_args(self.keys, self.semaphore_retention_ms, indexes, items, slots)
        return ("EVALSHA", self.extend_sha, 0, *args)

    def _read_extend(
        self,
        conn: Any,
        chunks: list[list[int]],
        items: Sequence[tuple[str, str, int]],
        slots: Sequence[bool],
    ) -> list[list[Any]]:
        """The reply to each chunk's script, read in order (every reply, so the connection
        stays clean); -1 for each lock of a script the node refused to run."""
        replies: list[list[Any] | None] = []
        for chunk in chunks:
            try:
                replies.append(list(conn.read_response()))
            except NoScriptError:
                replies.append(None)
            except ResponseError:
                # READONLY (a demoted master), CLUSTERDOWN, ...: the script did not run.
                replies.append([-1] * len(chunk))
        again = [k for k, reply in enumerate(replies) if reply is None]
        if again:
            # A node that never saw the script (a replica promoted since, a restart): load
            # it there and send those again; they did not run.
            conn.send_command("SCRIPT", "LOAD", self.extend_source)
            conn.read_response()
            conn.send_packed_command(
                conn.pack_commands([self._extend_command(chunks[k], items, slots) for k in again])
            )
            for k in again:
                try:
                    replies[k] = list(conn.read_response())
                except ResponseError:
                    replies[k] = [-1] * len(chunks[k])
        return [reply if reply is not None else [] for reply in replies]
