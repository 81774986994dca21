"""Job records (DONE, FAILED) and publish claims on etcd, each on a timed lease."""

from __future__ import annotations

import functools
import json
from typing import Any

from jobfence.locks.backend import JobRecord
from jobfence.locks.backends.etcd.core import EtcdCore
from jobfence.locks.backends.etcd.ops import (
    absent,
    delete_op,
    equals,
    kv_of,
    mod_at,
    put_op,
    range_op,
    text_of,
)
from jobfence.locks.errors import BackendUnavailable


def parse_record(state: str, text: str) -> JobRecord:
    """A job record as `done/k` or `failed/k` stores it (JSON)."""
    fields = json.loads(text or "{}")
    return JobRecord(
        state=state,
        fingerprint=str(fields.get("fingerprint", "")),
        result=str(fields.get("result", "")),
        fence=int(fields.get("fence", 0)),
        finished_at=float(fields.get("finished", 0.0)),
    )


class EtcdRecords(EtcdCore):
    """The job-record and publish-claim half of EtcdBackend."""

    def job_record(self, key: str) -> JobRecord | None:
        ops = [range_op(self._key("done", key)), range_op(self._key("failed", key))]
        done, failed = (kv_of(r) for r in self._read("job_record", key, ops))
        if done is not None:
            return parse_record("DONE", text_of(done))
        if failed is not None:
            return parse_record("FAILED", text_of(failed))
        return None

    def forget(self, key: str) -> bool:
        reply = self._txn(
            "forget", key, [], [delete_op(self._key(k, key)) for k in ("done", "failed")]
        )
        return any(
            int(r.get("response_delete_range", {}).get("deleted", 0)) for r in reply["responses"]
        )

    def claim_publish(self, key: str, task_id: str, ttl: float) -> str | None:
        queued = self._key("queued", key)

        def send(lease: str) -> dict[str, Any]:
            return self._txn(
                "claim_publish",
                key,
                [absent(queued)],
                [put_op(queued, task_id, lease)],
                [{"request_txn": {
                    "compare": [equals(queued, task_id)],
                    "success": [put_op(queued, task_id, lease)],
                    "failure": [range_op(queued)],
                }}],
            )  # fmt: skip

        reply = self._on_timed_lease(ttl, key, send)
        if reply.get("succeeded"):
            return None
        nested = reply["responses"][0].get("response_txn", {})
        if nested.get("succeeded"):
            return None
        held = text_of(kv_of(nested["responses"][0]))
        return held if held and held != task_id else None

    def clear_publish(self, key: str) -> None:
        self._txn("clear_publish", key, [], [delete_op(self._key("queued", key))])

    def _swap_publish(self, key: str, expect: str, new: str | None, ttl_ms: int) -> str | None:
        queued = self._key("queued", key)

        def send(lease: str | None) -> dict[str, Any]:
            change = [delete_op(queued) if new is None else put_op(queued, new, lease)]
            # absent, or expect, or new: nested txns, each falling through to the next test
            last: list[dict[str, Any]] = [range_op(queued)]
            for value in [expect] + ([new] if new is not None and new != expect else []):
                last = [{"request_txn": {
                    "compare": [equals(queued, value)], "success": change, "failure": last}}]
            return self._txn("swap_publish", key, [absent(queued)], change, last)

        reply = send(None) if new is None else self._on_timed_lease(ttl_ms / 1000, key, send)
        while not reply.get("succeeded"):
            inner = reply["responses"][0]
            if "response_txn" not in inner:
                return text_of(kv_of(inner)) or None
            reply = inner["response_txn"]
        return None

    def _count_delivery(self, key: str, window_ms: int) -> int | None:
        name = self._key("deliveries", key)
        for _ in range(8):  # racing increments: re-read and try again
            kv = kv_of(self._read("count_delivery", key, [range_op(name)])[0])
            count = int(text_of(kv) or 0) + 1
            revision = int(kv.get("mod_revision", 0)) if kv is not None else 0
            guard = mod_at(name, revision) if kv is not None else absent(name)
            put = functools.partial(self._put_guarded, "count_delivery", key, guard, name, count)
            reply = self._on_timed_lease(window_ms / 1000, key, put)
            if reply.get("succeeded"):
                return count
        raise BackendUnavailable("etcd count_delivery kept racing", key=key)

    def _put_guarded(
        self, what: str, key: str, guard: dict[str, Any], name: str, value: object, lease: str
    ) -> dict[str, Any]:
        return self._txn(what, key, [guard], [put_op(name, str(value), lease)])
