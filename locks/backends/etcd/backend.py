"""EtcdBackend: the etcd lock backend's class, its parts put together, and its cluster twin."""

from __future__ import annotations

from typing import ClassVar, Unpack

from jobfence.locks.backend import Capabilities, Security, validate_ttl
from jobfence.locks.backends.common import UrlOptions, url_options
from jobfence.locks.backends.etcd.checks import EtcdChecks
from jobfence.locks.backends.etcd.core import whole_seconds
from jobfence.locks.backends.etcd.grants import EtcdGrants
from jobfence.locks.backends.etcd.inspection import EtcdInspection
from jobfence.locks.backends.etcd.records import EtcdRecords
from jobfence.locks.backends.etcd.target import parse_target


class EtcdBackend(EtcdGrants, EtcdRecords, EtcdInspection, EtcdChecks):
    """Locks on an etcd cluster through its v3 JSON gateway. Build with `from_url`.

    Per lock key `k` (under `prefix`): `lock/k` holds the owner token, `holder/k` what
    `inspect` shows, `beat/k` the last heartbeat; all three sit on this process's lease for
    that TTL (one lease per process and TTL, as etcd's own concurrency.Session does), so a
    process that stops keeping its lease alive loses all its locks together. A grant is
    one txn that creates the keys if `lock/k` is absent; the fence is the key's create
    revision above a per-deployment base (µs clock when the base was created), so a new
    cluster (a fresh data directory) starts above every fence an older one issued.
    Job records (`done/k`, `failed/k`) sit on leases that outlive the record's TTL by a
    little, shared by the records of a few seconds, so they cost no round trip of their own.
    """

    name: ClassVar[str] = "etcd"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=False, release_notify=True
    )

    @classmethod
    def from_url(cls, url: str, **options: Unpack[UrlOptions]) -> EtcdBackend:
        """`etcd[s]://[user:password@]host:port[,host:port...][?cacert=&cert=&key=]`: one
        endpoint, or several members to fail over (see `parse_target`). A fence retention
        is accepted and unused: etcd keeps its revisions."""
        o = url_options(options)
        target = parse_target(url)
        endpoints = target.endpoints
        kind = cls if len(endpoints) == 1 or cls is not EtcdBackend else EtcdClusterBackend
        return kind(endpoints, prefix=o.prefix, socket_timeout=o.socket_timeout, clock=o.clock,
                    tls=target.tls, user=target.user, password=target.password)  # fmt: skip

    def security(self) -> Security:
        """TLS as the URL asked (etcds://, insecure_skip_tls_verify), auth: a user and
        password, or a client certificate."""
        tls = self.tls is not None
        verified = tls and self.tls is not None and self.tls.verify
        return Security(
            tls=tls,
            verified=verified,
            hostname_checked=verified,
            auth=self.user is not None or (self.tls is not None and self.tls.cert is not None),
        )

    @staticmethod
    def granted_ttl(ttl: float) -> float:
        """The TTL a lease asked for `ttl` seconds really gets (at least; etcd may raise it
        to its own floor, and the Lease then reports that)."""
        return float(whole_seconds(validate_ttl(ttl)))

    def close(self) -> None:
        self._sweep()  # best effort: errors wait for the leases to run out
        self.gateway.close()


class EtcdClusterBackend(EtcdBackend):
    """An EtcdBackend given several members: it fails over between them, so it survives the
    loss of one (a majority must stay up for etcd to answer at all)."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=True, ha=True, release_notify=True
    )
