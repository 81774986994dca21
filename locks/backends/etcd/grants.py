"""Granting, extending, releasing and committing etcd locks, and waiting for one's release."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from jobfence.locks.backend import Busy, CommitRecord, JobRecord, validate_key
from jobfence.locks.backends.etcd.core import EtcdCore, whole_seconds
from jobfence.locks.backends.etcd.errors import GatewayError, OutcomeUnknown, Unreachable
from jobfence.locks.backends.etcd.gateway import b64
from jobfence.locks.backends.etcd.ops import (
    TXN_CHUNK,
    absent,
    created_at,
    delete_op,
    equals,
    kv_of,
    lease_gone,
    moved_op,
    present,
    put_op,
    range_op,
    text_of,
    txn_chunks,
)
from jobfence.locks.backends.etcd.records import parse_record
from jobfence.locks.errors import BackendUnavailable
from jobfence.locks.lease import Lease, OwnerMeta

#: Longest one wait_for_release blocks in a watch (the caller loops anyway).
MAX_WAIT = 30.0


def holder_json(meta: OwnerMeta, fingerprint: str, acquired: float, ttl: int) -> str:
    """What `holder/k` holds for `inspect` (JSON): the owner, when, and its lease's TTL."""
    return json.dumps({
        "host": meta.host, "pid": meta.pid, "task_id": meta.task_id,
        "task_name": meta.task_name, "process_start": meta.process_start,
        "fingerprint": fingerprint, "acquired": acquired, "ttl": ttl,
    }, separators=(",", ":"))  # fmt: skip


class EtcdGrants(EtcdCore):
    """The lock half of EtcdBackend: one txn per grant, extend, release and commit."""

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
        now = time.time()
        # A grant or release of ours that got no answer may still hold a key (maybe this
        # one), kept alive by this very process's lease: delete those first.
        self._sweep()
        for _ in range(4):
            base, base_text = self._fence_base(key)
            session = self._session(ttl, key)
            shown = holder_json(meta, fingerprint if record else "", now, session.ttl)
            try:
                reply = self._grant_txn(key, owner, session.id, shown, now, base_text, record)
            except BackendUnavailable as exc:
                if lease_gone(exc):
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
            refused = self._refused(key, reply["responses"], revision, base_text, record, ttl)
            if refused is not None:
                return refused
        raise BackendUnavailable("etcd begin did not settle (lease or fence base kept changing)",
                                 key=key)  # fmt: skip

    def _grant_txn(
        self, key: str, owner: str, lease: str, shown: str, now: float, base_text: str,
        record: bool,
    ) -> dict[str, Any]:  # fmt: skip
        """The grant's one txn: the keys put on `lease` if `lock/k` is absent and the fence
        base is `base_text` (with `record`, and no DONE record); else it reads why not."""
        lock, holder, beat = (self._key(k, key) for k in ("lock", "holder", "beat"))
        done, failed = self._key("done", key), self._key("failed", key)
        compare = [absent(lock), equals(self._base_key, base_text)]
        success = [put_op(lock, owner, lease), put_op(holder, shown, lease),
                   put_op(beat, repr(now), lease)]  # fmt: skip
        failure = [range_op(lock), range_op(holder), range_op(self._base_key)]
        if record:
            compare.append(absent(done))
            success.append(delete_op(failed))  # an earlier run's FAILED record goes
            failure.append(range_op(done))
        return self._txn("begin", key, compare, success, failure, suspect=(key, owner))

    def _refused(
        self, key: str, responses: list[Any], revision: int, base_text: str, record: bool,
        ttl: int,
    ) -> Busy | JobRecord | None:  # fmt: skip
        """What a refused grant met, from its failure reads: the holder (Busy) or the DONE
        record; None to try again (the fence base changed, or the key was let go)."""
        held, info, stored = (kv_of(r) for r in responses[:3])
        if stored is None or text_of(stored) != base_text:
            self._base = None  # a new cluster or a restore: take its base, and again
            return None
        if record and (rec := kv_of(responses[3])) is not None:
            return parse_record("DONE", text_of(rec))
        if held is None:
            return None
        self._local.busy = (key, revision)  # wait_for_release watches from here
        holder_fields = json.loads(text_of(info) or "{}")
        # The holder's lease TTL bounds its time left (its keeper renews it every
        # third of it); asking etcd for the exact figure would cost a round trip
        # per refused attempt, and waiters are woken by a watch anyway.
        return Busy(
            ttl_left=float(holder_fields.get("ttl", ttl)),
            task_id=str(holder_fields.get("task_id", "")),
            fingerprint=str(holder_fields.get("fingerprint", "")),
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
            [equals(lock, owner), present(holder)],
            [moved_op(lock, session.id), moved_op(holder, session.id),
             put_op(beat, repr(time.time()), session.id)],
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
        for chunk in txn_chunks(items):
            ops = []
            for key, owner, _ in (items[i] for i in chunk):
                lock, beat = self._key("lock", key), self._key("beat", key)
                ops.append({"request_txn": {
                    "compare": [equals(lock, owner), present(beat)],
                    "success": [{"request_put": {"key": b64(beat), "value": b64(now),
                                                 "ignore_lease": True}}, range_op(lock)],
                }})  # fmt: skip
            reply = self._txn("extend_many", None, [], ops)
            for offset, response in enumerate(reply.get("responses", [])):
                nested = response.get("response_txn", {})
                if not nested.get("succeeded"):
                    continue
                held = kv_of(nested["responses"][1])
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
                "compare": [equals(lock, owner)],
                "success": [delete_op(lock), delete_op(self._key("holder", key)),
                            delete_op(self._key("beat", key))],
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
            [equals(lock, owner)],
            [delete_op(self._key(k, key)) for k in ("lock", "holder", "beat")],
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
                [equals(lock, owner), created_at(lock, fence - base)],
                [put_op(self._key(mine, key), text, lease), delete_op(self._key(other, key)),
                 delete_op(lock), delete_op(self._key("holder", key)),
                 delete_op(self._key("beat", key))],
                suspect=(key, owner),
            )  # fmt: skip

        reply = self._on_timed_lease(result_ttl_ms / 1000, key, send)
        return bool(reply.get("succeeded"))

    def force_release(self, key: str) -> bool:
        reply = self._txn(
            "force_release",
            key,
            [],
            [delete_op(self._key(k, key)) for k in ("lock", "holder", "beat")],
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
            [created_at(lock, fence - base), equals(self._base_key, base_text)],
            [delete_op(self._key(k, key)) for k in ("lock", "holder", "beat")],
        )
        return bool(reply.get("succeeded"))

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
