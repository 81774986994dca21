"""Housekeeping: expired job records and markers, and key nodes unused for the fence retention."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NoNodeError,
    NotEmptyError,
    ZookeeperError,
)
from kazoo.handlers.threading import KazooTimeoutError

from jobfence.locks.backends.zookeeper.core import TRANSPORT
from jobfence.locks.backends.zookeeper.nodes import node_json
from jobfence.locks.backends.zookeeper.session import Session
from jobfence.locks.backends.zookeeper.sessions import Sessions
from jobfence.locks.errors import BackendUnavailable

log = logging.getLogger(__package__)  # one logger for the package's modules


class Pruning(Sessions):
    """ZooKeeperBackend's pruning: a turn per interval, across processes."""

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

    def _gather(self, session: Session, starts: list[Callable[[], Any]]) -> list[Any]:
        """Send every request at once, then collect: answers (or the server's error)."""
        pending = [start() for start in starts]
        self.requests += len(pending)
        out: list[Any] = []
        for answer in pending:
            try:
                out.append(answer.get(timeout=self.socket_timeout))
            except ZookeeperError as exc:
                if isinstance(exc, TRANSPORT):
                    raise BackendUnavailable("zookeeper request failed", cause=exc) from exc
                out.append(exc)
            except (KazooTimeoutError, KazooException) as exc:
                raise BackendUnavailable("zookeeper request failed", cause=exc) from exc
        return out

    def _prune_bucket(self, session: Session, bucket: str) -> int:
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
                if stat.mtime / 1000 + int(node_json(data).get("ttl_ms", 0)) / 1000 > now:
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
