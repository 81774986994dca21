"""Private etcd servers on 127.0.0.1 (one node or a cluster, TLS and auth optional), run by us."""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import ipaddress
import json
import shutil
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from devstack import pki as _pki
from devstack import procs
from devstack.redis_server import HOST, free_port

__all__ = ["EtcdCluster", "EtcdServerError", "EtcdTLS", "client_certificate", "etcd_unavailable",
           "server_certificate"]

EXECUTABLE = "etcd"


class EtcdServerError(RuntimeError):
    """A private etcd could not be started."""


def etcd_unavailable(executable: str = EXECUTABLE) -> str | None:
    """Why a private etcd cannot run here (no binary), or None."""
    if shutil.which(executable) is None:
        return f"{executable!r} is not on PATH (Debian: apt-get install etcd-server)"
    return None


@dataclass(frozen=True)
class EtcdTLS:
    """HTTPS on the members' client ports (peers stay on loopback HTTP), and the client
    certificate this launcher's own calls present (/health, setting up auth)."""

    ca: Path  # etcd's --trusted-ca-file, and the CA the launcher trusts
    cert: Path  # the serving certificate: see `server_certificate`
    key: Path
    client_cert_auth: bool = False  # --client-cert-auth: a client certificate from `ca`
    client_cert: Path | None = None
    client_key: Path | None = None

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if self.client_cert is not None:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


def server_certificate(pki: _pki.Pki, where: Path) -> tuple[Path, Path]:
    """(cert, key): a certificate from `pki`'s CA for localhost and 127.0.0.1 that etcd can
    serve with --client-cert-auth. etcd's JSON gateway presents the serving certificate to
    etcd's own gRPC server, so it must allow clientAuth as well as serverAuth."""
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca.with_suffix(".key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _pki._key()
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(HOST))
    ]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = _pki._certificate("etcd-server", key, (ca, ca_key), names=names, usage=usage)
    path = _pki._write(where / "etcd-server.pem", cert, key)
    return path, path.with_suffix(".key")


def client_certificate(pki: _pki.Pki, where: Path) -> tuple[Path, Path]:
    """(cert, key): a client certificate from `pki`'s CA with no Common Name (the client
    named in its SAN), which etcd's JSON gateway accepts with --client-cert-auth and auth
    on: it refuses one with a CN, which it would not use as the user."""
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca.with_suffix(".key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _pki._key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("jobfence-client")]), critical=True
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    path = _pki._write(where / "etcd-client.pem", cert, key)
    return path, path.with_suffix(".key")


@dataclass
class _Node:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    server: procs.ServerProcess = field(repr=False)
    scheme: str = "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.server.running


def _get_json(url: str, timeout: float, context: ssl.SSLContext | None = None) -> Any:
    with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
        return json.loads(reply.read())


def _post_json(
    url: str,
    body: dict[str, Any],
    timeout: float,
    context: ssl.SSLContext | None = None,
    token: str = "",
) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
        return json.loads(reply.read())


def _status(
    node: _Node, timeout: float, context: ssl.SSLContext | None = None
) -> dict[str, Any]:
    """A running member's /v3/maintenance/status, or {} (stopped, or no answer)."""
    if not node.running:
        return {}
    try:
        status = _post_json(f"{node.client_url}/v3/maintenance/status", {}, timeout, context)
    except (OSError, ValueError, urllib.error.URLError):
        return {}
    return status if isinstance(status, dict) else {}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # prefixes here end in '/', never 0xff
    return base64.b64encode(bytes(raw)).decode("ascii")


class EtcdCluster(procs.Launcher):
    """`size` etcd members on free loopback ports, as child processes of this one.

    Usage::

        with EtcdCluster(size=3, election_timeout_ms=500, heartbeat_ms=50) as cluster:
            backend = EtcdBackend.from_url(cluster.url)

    Data directories live under `workdir` (kept if given, else a temporary directory that
    `stop()` deletes). Ports are chosen at the first start and kept, so a member restarted
    with `start_member` (its data kept) or a cluster restarted with `restart(fresh=True)`
    (data wiped: a brand-new cluster) answers on the same URL.
    """

    def __init__(
        self,
        size: int = 1,
        *,
        executable: str = EXECUTABLE,
        workdir: str | Path | None = None,
        election_timeout_ms: int = 1000,
        heartbeat_ms: int = 100,
        startup_timeout: float = 30.0,
        extra_args: Sequence[str] = (),
        tls: EtcdTLS | None = None,
        also_listen: Sequence[str] = (),
    ) -> None:
        """`tls`: HTTPS client ports (and `--client-cert-auth` if it says so); `also_listen`:
        more loopback addresses (e.g. 127.0.0.2) each member's client port answers on."""
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.tls = tls
        self.also_listen = tuple(also_listen)
        self._context = tls.context() if tls is not None else None
        self.size = size
        self.executable = executable
        self.election_timeout_ms = election_timeout_ms
        self.heartbeat_ms = heartbeat_ms
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self._dir = procs.Workdir(workdir, "jobfence-etcd-")
        self._nodes: list[_Node] = []
        self._token = ""

    # -- addresses --------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        """host:port of every member's client URL."""
        return [f"{HOST}:{n.client_port}" for n in self._require_nodes()]

    @property
    def scheme(self) -> str:
        """etcds with TLS, else etcd."""
        return "etcds" if self.tls is not None else "etcd"

    @property
    def url(self) -> str:
        """The `etcd://` lock URL listing every member (`etcds://` with TLS, no options)."""
        return f"{self.scheme}://" + ",".join(self.endpoints)

    def member_url(self, index: int) -> str:
        """The `etcd://` URL of member `index` alone."""
        return f"{self.scheme}://{self.endpoints[index]}"

    def client_url(self, index: int) -> str:
        """The member's http:// client URL (its JSON gateway)."""
        return self._require_nodes()[index].client_url

    def pid(self, index: int) -> int:
        return self._require_nodes()[index].server.pid

    def running(self, index: int) -> bool:
        return self._require_nodes()[index].running

    @property
    def workdir(self) -> Path:
        return self._dir.path

    def _require_nodes(self) -> list[_Node]:
        if not self._nodes:
            raise RuntimeError("EtcdCluster has not been started yet")
        return self._nodes

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> Self:
        """Start every member and wait until each answers /health; idempotent."""
        reason = etcd_unavailable(self.executable)
        if reason:
            raise EtcdServerError(reason)
        self._dir.make()
        fresh = not self._nodes
        for attempt in range(3 if fresh else 1):
            if not self._nodes:
                self._plan()
            for node in self._nodes:
                if not node.running:
                    self._spawn(node)
            try:
                self.wait_healthy()
                return self
            except EtcdServerError as exc:
                # free_port() is racy: another process may take a port before etcd does.
                if attempt == 2 or not fresh or "address already in use" not in str(exc):
                    raise
                self._discard_plan()
        raise AssertionError("unreachable")

    def _discard_plan(self) -> None:
        for node in self._nodes:
            node.server.kill()
            shutil.rmtree(node.data_dir.parent, ignore_errors=True)
        self._nodes.clear()

    def _plan(self) -> None:
        ports: set[int] = set()
        while len(ports) < 2 * self.size:
            ports.add(free_port())
        ordered = sorted(ports)
        self._token = f"jobfence-{ordered[0]}-{int(time.time() * 1000)}"
        for i in range(self.size):
            base = self.workdir / f"m{i}"
            base.mkdir(parents=True, exist_ok=True)
            self._nodes.append(
                _Node(
                    name=f"m{i}",
                    client_port=ordered[2 * i],
                    peer_port=ordered[2 * i + 1],
                    data_dir=base / "data",
                    log_path=base / "etcd.log",
                    server=procs.ServerProcess(
                        f"etcd member m{i} on port {ordered[2 * i]}", error=EtcdServerError
                    ),
                    scheme="https" if self.tls is not None else "http",
                )
            )

    def _command(self, node: _Node) -> list[str]:
        initial = ",".join(f"{n.name}={n.peer_url}" for n in self._nodes)
        listen = [node.client_url] + [
            f"{node.scheme}://{host}:{node.client_port}" for host in self.also_listen
        ]
        tls: list[str] = []
        if self.tls is not None:
            tls = ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                   "--trusted-ca-file", str(self.tls.ca)]  # fmt: skip
            if self.tls.client_cert_auth:
                tls.append("--client-cert-auth")
        return [
            self.executable,
            "--name", node.name,
            "--data-dir", str(node.data_dir),
            "--listen-client-urls", ",".join(listen),
            *tls,
            "--advertise-client-urls", node.client_url,
            "--listen-peer-urls", node.peer_url,
            "--initial-advertise-peer-urls", node.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-token", self._token,
            "--initial-cluster-state", "new",  # ignored once the data dir exists
            "--election-timeout", str(self.election_timeout_ms),
            "--heartbeat-interval", str(self.heartbeat_ms),
            # History kept for watches that resume from a revision; compacted after that
            # so a long-running server does not grow to its space quota.
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
            "--logger", "zap",
            "--log-level", "warn",
            *self.extra_args,
        ]  # fmt: skip

    def _spawn(self, node: _Node) -> None:
        node.server.spawn(self._command(node), log_path=node.log_path)

    def healthy(self, index: int, timeout: float = 1.0) -> bool:
        """True if member `index` answers /health with health true (it sees a leader)."""
        node = self._require_nodes()[index]
        if not node.running:
            return False
        try:
            reply = _get_json(f"{node.client_url}/health", timeout, self._context)
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return bool(reply.get("health") in ("true", True))

    def wait_healthy(self, indexes: Sequence[int] | None = None) -> None:
        """Wait until the members (all running ones by default) answer /health."""
        nodes = self._require_nodes()
        wanted = list(indexes) if indexes is not None else [
            i for i, n in enumerate(nodes) if n.server.proc is not None
        ]
        deadline = time.monotonic() + self.startup_timeout
        for i in wanted:
            remaining = max(0.0, deadline - time.monotonic())
            nodes[i].server.wait_ready(functools.partial(self.healthy, i), remaining, interval=0.02)

    def leader(self, timeout: float = 1.0) -> int | None:
        """Index of the member that is leader now (as a running member reports it), or None."""
        nodes = self._require_nodes()
        for node in nodes:
            leader_id = _status(node, timeout, self._context).get("leader")
            if not leader_id or leader_id == "0":
                continue
            for i, other in enumerate(nodes):
                own = _status(other, timeout, self._context)
                if own.get("header", {}).get("member_id") == leader_id:
                    return i
        return None

    # -- authentication --------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any], *, token: str = "", index: int = 0) -> Any:
        """POST `body` to member `index`'s JSON gateway (over TLS with the launcher's client
        certificate where it has one), with `token` in the Authorization header."""
        url = self._require_nodes()[index].client_url + path
        return _post_json(url, body, 5.0, self._context, token)

    def token(self, user: str, password: str, *, index: int = 0) -> str:
        """A token for `user` from member `index` (tokens are member-local)."""
        reply = self.post("/v3/auth/authenticate", {"name": user, "password": password},
                          index=index)  # fmt: skip
        return str(reply["token"])

    def enable_auth(self, root_password: str, users: dict[str, tuple[str, str]]) -> None:
        """Turn on authentication: user root (role root) with `root_password`, and for each
        `name: (password, prefix)` a user with a role that may read and write keys under
        `prefix` (as etcdctl user add / role grant-permission --prefix / auth enable)."""
        self.post("/v3/auth/user/add", {"name": "root", "password": root_password})
        self.post("/v3/auth/user/grant", {"user": "root", "role": "root"})
        for name, (password, prefix) in users.items():
            role = f"{name}-rw"
            self.post("/v3/auth/role/add", {"name": role})
            self.post("/v3/auth/role/grant", {"name": role, "perm": {
                "permType": "READWRITE", "key": _b64(prefix), "range_end": _prefix_end(prefix),
            }})  # fmt: skip
            self.post("/v3/auth/user/add", {"name": name, "password": password})
            self.post("/v3/auth/user/grant", {"user": name, "role": role})
        self.post("/v3/auth/enable", {})

    def kill_member(self, index: int) -> None:
        """SIGKILL member `index` (a crash) and reap it; its data directory is kept."""
        self._require_nodes()[index].server.kill()

    def stop_member(self, index: int, timeout: float = 10.0) -> None:
        """SIGTERM member `index` (SIGKILL after `timeout`), reap it; its data is kept."""
        self._require_nodes()[index].server.stop(timeout)

    def start_member(self, index: int, *, wait: bool = True) -> None:
        """Start member `index` again from its data directory (same ports)."""
        node = self._require_nodes()[index]
        if not node.running:
            self._spawn(node)
        if wait:
            self.wait_healthy([index])

    def pause_member(self, index: int) -> None:
        """SIGSTOP member `index`: its connections stay open, nothing is answered."""
        self._require_nodes()[index].server.pause()

    def resume_member(self, index: int) -> None:
        self._require_nodes()[index].server.resume()

    def restart(self, *, fresh: bool = False, kill: bool = True) -> Self:
        """Stop every member (SIGKILL with `kill`, else SIGTERM) and start them again on the
        same ports: from their data directories, or with `fresh` from empty ones (a new
        cluster: every key, lease and revision is gone)."""
        nodes = self._require_nodes()
        for i in range(len(nodes)):
            if kill:
                self.kill_member(i)
            else:
                self.stop_member(i)
        if fresh:
            self._token = f"{self._token.rsplit('-', 1)[0]}-{int(time.time() * 1000)}"
            for node in nodes:
                shutil.rmtree(node.data_dir, ignore_errors=True)
        for node in nodes:
            self._spawn(node)
        self.wait_healthy()
        return self

    def stop(self, timeout: float = 10.0, *, kill: bool = False) -> None:
        """Stop every member (SIGTERM, SIGKILL after `timeout`; SIGKILL at once with `kill`:
        a cluster whose data goes anyway), reap, delete the temp dir."""
        for node in self._nodes:
            if kill:
                node.server.kill()
            else:
                node.server.stop(timeout)
        self._dir.remove()
        self._nodes.clear()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(
            f"--- {n.name} ({n.log_path}) ---\n{procs.tail(n.log_path, lines)}" for n in self._nodes
        )

    @contextlib.contextmanager
    def member_paused(self, index: int) -> Iterator[None]:
        self.pause_member(index)
        try:
            yield
        finally:
            self.resume_member(index)

    def __repr__(self) -> str:
        where = ",".join(self.endpoints) if self._nodes else "not started"
        return f"EtcdCluster(size={self.size}, {where})"
