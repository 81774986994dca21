"""Reading held etcd locks: inspect one key, scan many a page at a time, a holder's time left."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Iterator
from typing import Any

from jobfence.locks.backend import LockInfo
from jobfence.locks.backends.etcd.core import EtcdCore
from jobfence.locks.backends.etcd.gateway import b64, unb64
from jobfence.locks.backends.etcd.ops import (
    TXN_CHUNK,
    glob_head,
    key_after,
    kv_of,
    prefix_end,
    range_op,
    text_of,
)

#: Scan reads held locks this many at a time.
SCAN_PAGE = 500


class EtcdInspection(EtcdCore):
    """The inspect and scan half of EtcdBackend."""

    # -- time left, inspect, scan -------------------------------------------------------
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

    def _inspect(self, key: str) -> LockInfo | None:
        held, info, beat = (
            kv_of(r)
            for r in self._read(
                "inspect",
                key,
                [range_op(self._key(k, key)) for k in ("lock", "holder", "beat")],
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
        fields = json.loads(text_of(info) or "{}")
        acquired = float(fields.get("acquired", 0.0))
        beat_text = text_of(beat)
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
        start = (head + glob_head(match)).encode()
        end = prefix_end(start)
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
            start = key_after(unb64(kvs[-1]["key"]))

    def _page(self, wanted: list[tuple[str, dict[str, Any]]]) -> Iterator[LockInfo]:
        if not wanted:
            return
        ops = []
        for key, _ in wanted:
            ops += [range_op(self._key("holder", key)), range_op(self._key("beat", key))]
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
            yield self._info(key, held, kv_of(responses[2 * i]), kv_of(responses[2 * i + 1]),
                             ttl_left)  # fmt: skip
