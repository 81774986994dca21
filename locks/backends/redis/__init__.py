"""The Redis lock backends: one server, Sentinel and Cluster, each sync and asyncio."""

from __future__ import annotations

from jobfence.locks.backends.redis.backend import RedisBackend
from jobfence.locks.backends.redis.protocol import EXTEND_CHUNK, client_options, parse_record
from jobfence.locks.backends.redis.url import CA_FILE_HINT, tls_hint

__all__ = ["CA_FILE_HINT", "EXTEND_CHUNK", "RedisBackend", "client_options", "parse_record",
           "tls_hint"]  # fmt: skip
