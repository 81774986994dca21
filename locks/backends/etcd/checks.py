"""The etcd backend's start-up checks: version, alarms, TLS, login and permissions."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

from jobfence.config.findings import Finding, LockTarget
from jobfence.locks.backends.common import server_findings
from jobfence.locks.backends.etcd.core import EtcdCore
from jobfence.locks.backends.etcd.errors import GatewayError, SetupError, Unreachable
from jobfence.locks.backends.etcd.ops import range_op
from jobfence.locks.backends.etcd.target import TLS_SCHEME
from jobfence.locks.errors import BackendUnavailable

VERSION_NEEDED = (3, 4)


class EtcdChecks(EtcdCore):
    """The start-up check half of EtcdBackend: what in the server breaks it, and its fix."""

    def _ping(self) -> str:
        return f"etcd {self.gateway.get('/version').get('etcdserver', '?')}"

    def startup_findings(self, target: LockTarget) -> Iterator[Finding]:
        return server_findings(target, self.server_problems)

    def server_problems(self) -> list[tuple[str, str]]:
        """What in the server breaks this backend (start-up check): (problem, fix) pairs."""
        try:
            reply = self.gateway.get("/version")
            # A read under the prefix: the TLS set-up, the login and the user's permission.
            self._read("check", None, [range_op(self._base_key)])
        except SetupError as exc:
            return [(exc.problem, exc.fix)]
        except (Unreachable, GatewayError) as exc:
            found = self.setup_problem(exc)
            if found is not None:
                return [found]
            if self.tls is None and (tls_at := self._serving_tls()):
                return [(f"etcd at {tls_at} serves HTTPS and the lock URL is etcd:// (plain "
                         "HTTP)", f"use {TLS_SCHEME}://host:port?cacert=/path/ca.pem (the CA of "
                         "etcd's --cert-file)")]  # fmt: skip
            raise BackendUnavailable("etcd check failed", cause=exc) from exc
        version = str(reply.get("etcdserver", "0.0"))
        try:
            numbers = tuple(int(x) for x in version.split(".")[:2])
        except ValueError:
            numbers = (0, 0)
        if numbers < VERSION_NEEDED:
            return [(f"the etcd server is version {version}: its JSON gateway is not at /v3",
                     "run etcd 3.4 or later")]  # fmt: skip
        try:
            alarms = self._call("alarms", None, "/v3/maintenance/alarm", {"action": "GET"},
                                idempotent=True)  # fmt: skip
        except SetupError:
            return []  # a user without the root role may not list alarms
        return [
            (f"the etcd server has alarm {alarm.get('alarm', '?')} raised, so it refuses writes",
             "compact and defragment it (etcdctl compact/defrag), then etcdctl alarm disarm")
            for alarm in alarms.get("alarms") or []
        ]  # fmt: skip

    def _serving_tls(self) -> str | None:
        """The first member that answers a TLS handshake (certificate unchecked: only to
        tell a plain etcd:// URL that its server speaks HTTPS), or None."""
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        for endpoint in self.endpoints:
            host, _, port = endpoint.rpartition(":")
            try:
                address = (host.strip("[]"), int(port))
                with (
                    socket.create_connection(address, timeout=self.socket_timeout) as raw,
                    probe.wrap_socket(raw, server_hostname=None),
                ):
                    return endpoint
            except ssl.SSLError as exc:  # an alert: TLS after all (it wanted a client cert)
                if "ALERT" in str(exc):
                    return endpoint
            except OSError:
                continue
        return None
