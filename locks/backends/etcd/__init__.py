"""The etcd lock backend: leases and txns on etcd's v3 JSON gateway, create revisions as fences.

One package: `target` (the URL), `gateway` (the HTTP client), `ops` (txn vocabulary),
`errors`, `core` (requests, leases, fence base), `grants`, `records`, `inspection` and
`checks` (the backend's parts) and `backend` (EtcdBackend, EtcdClusterBackend).
"""

from __future__ import annotations

from jobfence.locks.backends.etcd.backend import EtcdBackend, EtcdClusterBackend
from jobfence.locks.backends.etcd.core import MIN_TTL, REFRESH_FRACTION, whole_seconds
from jobfence.locks.backends.etcd.errors import SetupError
from jobfence.locks.backends.etcd.inspection import SCAN_PAGE
from jobfence.locks.backends.etcd.ops import TXN_CHUNK, txn_chunks
from jobfence.locks.backends.etcd.target import (
    SCHEMES,
    TLS,
    TLS_OPTIONS,
    TLS_SCHEME,
    Target,
    parse_endpoints,
    parse_target,
)

__all__ = [
    "MIN_TTL",
    "REFRESH_FRACTION",
    "SCAN_PAGE",
    "SCHEMES",
    "TLS",
    "TLS_OPTIONS",
    "TLS_SCHEME",
    "TXN_CHUNK",
    "EtcdBackend",
    "EtcdClusterBackend",
    "SetupError",
    "Target",
    "parse_endpoints",
    "parse_target",
    "txn_chunks",
    "whole_seconds",
]
