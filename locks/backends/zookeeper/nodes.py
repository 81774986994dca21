"""The nodes jobfence keeps: their names, a key's paths, their JSON data, what a grant holds."""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass, field
from typing import Any

from jobfence.locks.backends.zookeeper.session import Session
from jobfence.locks.lease import Lease


def node_name(key: str) -> str:
    """The node name of `key`: SHA-256 hex, 128 bits (keys run to 512 characters, and any
    character but '/' and a few control ones would do in a name, so the key is hashed)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def owner_digest(owner: str) -> str:
    """What the lock node keeps of the owner token: enough to find our own node after a
    grant whose answer was lost, never the token itself."""
    return hashlib.sha256(b"jobfence-owner\n" + owner.encode()).hexdigest()[:32]


def node_json(data: bytes) -> dict[str, Any]:
    """A node's data as a JSON object; {} if it holds none."""
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(eq=False)
class Grant:
    """What this process knows of a lock it was granted (the Lease holds the rest)."""

    key: str
    owner: str = field(repr=False)
    name: str
    session: Session = field(repr=False)
    sid: int  # the session the lock node belongs to
    version: int  # the key node's version after the grant: the owner check
    fence: int
    data: bytes = field(repr=False)  # the lock node's data, written again on each extension
    deadline: float  # monotonic: the lease's deadline (moved by each extension)
    lease: weakref.ref[Lease] | None = field(default=None, repr=False)
    reaping: bool = False

    def valid(self) -> bool:
        s = self.session
        return s.sid == self.sid


@dataclass(frozen=True)
class Paths:
    """A key's nodes: its lock node, its key node and that one's bucket (see ZooKeeperBackend)."""

    lock: str
    bucket: str
    key: str

    @property
    def job(self) -> str:
        return self.key + "/job"

    @property
    def queued(self) -> str:
        return self.key + "/queued"

    @property
    def deliveries(self) -> str:
        return self.key + "/deliveries"
