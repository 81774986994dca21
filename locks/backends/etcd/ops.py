"""etcd's v3 JSON vocabulary for txns: range, put and delete ops, compares on create
revision, mod revision and value, and reading their responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobfence.locks.backends.etcd.errors import GatewayError
from jobfence.locks.backends.etcd.gateway import b64, unb64
from jobfence.locks.errors import BackendUnavailable

#: Ops per txn: etcd refuses more than --max-txn-ops (128 by default) in one branch.
TXN_CHUNK = 100


def lease_gone(exc: BackendUnavailable) -> bool:
    """etcd refused a put on a lease it no longer has (expired, or a new cluster)."""
    return isinstance(exc.cause, GatewayError) and "lease not found" in exc.cause.message


def kv_of(response: dict[str, Any]) -> dict[str, Any] | None:
    """The one key-value of a txn's range response, or None if the key is absent."""
    kvs = response.get("response_range", {}).get("kvs") or []
    return kvs[0] if kvs else None


def text_of(kv: dict[str, Any] | None) -> str:
    """The value of `kv` as text ("" if it is absent or empty)."""
    return unb64(kv["value"]) if kv is not None and kv.get("value") else ""


def range_op(key: str) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


def delete_op(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key)}}


def put_op(key: str, value: str, lease: str | None = None) -> dict[str, Any]:
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease is not None:
        put["lease"] = lease
    return {"request_put": put}


def moved_op(key: str, lease: str) -> dict[str, Any]:
    """Put `key` on another lease, keeping its value (and its create revision)."""
    return {"request_put": {"key": b64(key), "ignore_value": True, "lease": lease}}


def absent(key: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def present(key: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "GREATER", "create_revision": "0"}


def created_at(key: str, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL",
            "create_revision": str(revision)}  # fmt: skip


def mod_at(key: str, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def equals(key: str, value: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def glob_head(match: str) -> str:
    """The literal start of glob `match`, before its first wildcard."""
    head = ""
    for ch in match:
        if ch in "*?[":
            break
        head += ch
    return head


def key_after(key: str) -> bytes:
    """The smallest key after `key` (for paging a range)."""
    return key.encode() + b"\0"


def txn_chunks(items: Sequence[tuple[str, str, int]]) -> list[list[int]]:
    """The indexes of `items` in txns of at most TXN_CHUNK, each naming a key once: etcd
    refuses a txn that names one key twice, and a batch may (a lost lease and the new one)."""
    chunks: list[list[int]] = []
    keys: set[str] = set()
    for i, (key, _, _) in enumerate(items):
        if not chunks or len(chunks[-1]) >= TXN_CHUNK or key in keys:
            chunks.append([])
            keys = set()
        chunks[-1].append(i)
        keys.add(key)
    return chunks
