"""Reading locks and job records (inspect, scan, forget), and the queued and deliveries markers."""

from __future__ import annotations

import contextlib
import fnmatch
import json
from collections.abc import Callable, Iterator
from typing import Any

from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError

from jobfence.locks.backend import JobRecord, LockInfo, validate_key
from jobfence.locks.backends.zookeeper.core import TRANSPORT, multi_failure
from jobfence.locks.backends.zookeeper.grant import ATTEMPTS, Granting
from jobfence.locks.backends.zookeeper.nodes import Paths, node_json, node_name
from jobfence.locks.backends.zookeeper.session import Session
from jobfence.locks.errors import BackendUnavailable


class Reading(Granting):
    """ZooKeeperBackend's reads, and the compare-and-set of its marker nodes."""

    def _info(self, key: str, data: bytes, stat: Any) -> LockInfo:
        holder = node_json(data)
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
            except (*TRANSPORT, KazooException) as exc:
                raise BackendUnavailable("zookeeper scan failed", cause=exc) from exc
            key = str(node_json(data).get("key", ""))
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
        return multi_failure(self._multi(session, "release_grant", key, ops)) is None

    def _key_node(self, session: Session, key: str, p: Paths) -> None:
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
                value = node_json(got[0])
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
