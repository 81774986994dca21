"""A private Redis Cluster on 127.0.0.1 (masters, optional replicas), started and stopped by pid."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import redis

from devstack import procs
from devstack.pki import Pki, redis_tls_args, tls_query
from devstack.redis_server import RedisServer, RedisServerError, free_port

__all__ = ["LocalCluster"]

SLOTS = 16384


class LocalCluster(procs.ServerGroup):
    """`masters` cluster-enabled redis-servers, each with `replicas` replicas, on free ports.

    Usage::

        with LocalCluster(masters=3, replicas=1) as cluster:
            backend = RedisClusterBackend.from_url(cluster.url)

    Built without redis-cli: slots are assigned with CLUSTER ADDSLOTSRANGE, nodes meet
    through CLUSTER MEET, replicas follow with CLUSTER REPLICATE. `start` returns once every
    node reports cluster_state:ok and every replica master_link_status:up (a master killed
    before its replica's first sync cannot fail over). Every server is a child process of
    this one, stopped by its pid.
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 2000,
        executable: str = "redis-server",
        startup_timeout: float = 30.0,
        tls: Pki | None = None,
        password: str | None = None,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"need masters >= 1 and replicas >= 0, got {masters}, {replicas}")
        self.startup_timeout = startup_timeout
        self.node_timeout_ms = node_timeout_ms
        self._dir = procs.Workdir(None, "jobfence-cluster-")
        self._dir.make()
        self.tls = tls
        self._plan = (masters * (1 + replicas), node_timeout_ms, executable, password)
        self._replan()
        self.n_masters = masters
        self.n_replicas = replicas
        self.ids: list[str] = []

    def _replan(self) -> bool:
        """Every node described afresh: new bus and TLS ports, empty node configs."""
        count, node_timeout_ms, executable, password = self._plan
        root = self._dir.path
        tls = self.tls
        self.servers: list[RedisServer] = []
        self.bus_ports: list[int] = []
        #: With `tls`: each node's TLS port, the one the cluster announces (tls-cluster yes),
        #: and the bus in TLS; the plain port serves the harness.
        self.tls_ports: list[int] = []
        for i in range(count):
            workdir = root / f"n{i}"
            (workdir / "nodes.conf").unlink(missing_ok=True)  # a failed try's, if any
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(workdir / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                # Its own bus port: the default (port + 10000) may be taken or above 65535.
                "--cluster-port", str(self._bus_port()),
                # A replica with a stale link may still fail over: the test kills masters
                # right after start-up, and loopback replication never lags long.
                "--cluster-replica-validity-factor", "0",
            ]  # fmt: skip
            if tls is not None:
                self.tls_ports.append(free_port())
                args += redis_tls_args(tls, self.tls_ports[-1], cluster=True)
            self.servers.append(RedisServer(executable=executable, extra_args=args,
                                            workdir=workdir, password=password))  # fmt: skip
        return True

    def _bus_port(self) -> int:
        self.bus_ports.append(free_port())
        return self.bus_ports[-1]

    @property
    def masters(self) -> list[RedisServer]:
        """The servers started as masters (after a failover, one may be a replica)."""
        return self.servers[: self.n_masters]

    @property
    def replicas(self) -> list[RedisServer]:
        return self.servers[self.n_masters :]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...`` (every node, as seeds; with TLS
        ``rediss+cluster://`` to the TLS ports, the password, the CA and client options)."""
        if self.tls is None:
            return "redis+cluster://" + ",".join(f"{s.host}:{s.port}" for s in self.servers)
        password = self.servers[0].password
        auth = f":{quote(password, safe='')}@" if password else ""
        hosts = ",".join(f"{s.host}:{p}" for s, p in zip(self.servers, self.tls_ports, strict=True))
        return f"rediss+cluster://{auth}{hosts}?{tls_query(self.tls)}"

    def client(self, index: int) -> redis.Redis:
        """A plain client of node `index` (not cluster-aware)."""
        return self.servers[index].client(decode_responses=True)

    # -- lifecycle ------------------------------------------------------------------
    def _formed(self) -> None:
        clients: list[Any] = [self.client(i) for i in range(len(self.servers))]
        self.ids = [str(c.execute_command("CLUSTER", "MYID")) for c in clients]
        per = SLOTS // self.n_masters
        for i, c in enumerate(clients[: self.n_masters]):
            first, last = i * per, (SLOTS - 1 if i == self.n_masters - 1 else (i + 1) * per - 1)
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            # Distinct epochs up front, as redis-cli does: no collision to resolve later.
            c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        ports = self.tls_ports or [s.port for s in self.servers]  # the port nodes announce
        for server, port, bus in zip(self.servers[1:], ports[1:], self.bus_ports[1:],
                                     strict=True):  # fmt: skip
            clients[0].execute_command("CLUSTER", "MEET", server.host, port, bus)
        everyone = len(self.servers)
        self._wait(lambda: all(self._known(c) == everyone for c in clients),
                   "every node to know every other")
        for j, c in enumerate(clients[self.n_masters :]):
            c.execute_command("CLUSTER", "REPLICATE", self.ids[j % self.n_masters])
        self._wait(lambda: all(self.state_ok(c) for c in clients), "cluster_state:ok")
        self._wait(lambda: all(self._link_up(c) for c in clients[self.n_masters :]),
                   "every replica's master_link_status:up")

    @staticmethod
    def _known(client: Any) -> int:
        text = str(client.execute_command("CLUSTER", "NODES"))
        return sum(1 for line in text.splitlines() if line and "handshake" not in line
                   and "noaddr" not in line)

    @staticmethod
    def state_ok(client: Any) -> bool:
        try:
            info = str(client.execute_command("CLUSTER", "INFO"))
        except redis.RedisError:
            return False
        return "cluster_state:ok" in info

    @staticmethod
    def _link_up(client: redis.Redis) -> bool:
        info = client.info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RedisServerError(f"redis cluster: no {what} within "
                                       f"{self.startup_timeout:g}s")
            time.sleep(0.05)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node reports cluster_state:ok (after a failover, say)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [s for s in self.servers if s.running and not s.paused]
            clients = [s.client(decode_responses=True, socket_timeout=1.0) for s in alive]
            if all(self.state_ok(c) for c in clients):
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"redis cluster not ok within {timeout:g}s")
            time.sleep(0.05)

    def node_of(self, name: str) -> int:
        """The index of the server that serves key `name` now (as a master)."""
        for server in self.servers:
            if not server.running or server.paused:
                continue
            c: Any = server.client(decode_responses=True, socket_timeout=1.0)
            with contextlib.suppress(redis.RedisError):
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", name))
                for first, last, *nodes in c.execute_command("CLUSTER", "SLOTS"):
                    if int(first) <= slot <= int(last):
                        host, port = nodes[0][0], int(nodes[0][1])
                        return next(k for k, s in enumerate(self.servers)
                                    if (s.host, s.port) == (host, port))
        raise LookupError(f"no running node serves {name!r}")

    def __repr__(self) -> str:
        return f"<LocalCluster {self.n_masters} masters x {self.n_replicas} replicas {self.url}>"
