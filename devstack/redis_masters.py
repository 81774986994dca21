"""N private redis-servers as the masters of a redlock:// URL, for tests and benchmarks."""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import quote

import redis

from devstack import procs
from devstack.pki import Pki, redis_tls_args, tls_query
from devstack.redis_server import RedisServer, free_port

__all__ = ["RedisMasters"]

#: Durable masters keep their append-only file here when the host has a tmpfs: fsync is then
#: free, and the masters still run with the settings a durable fence needs.
TMPFS = Path("/dev/shm")


class RedisMasters(procs.ServerGroup):
    """`n` independent private redis-servers on free ports of 127.0.0.1.

    ``durable=True`` runs each with ``appendonly yes`` and ``appendfsync always`` (what
    Redlock's durable fence needs), so a kill and restart keeps its data unless
    ``restart(i, keep_data=False)`` wipes it first.
    """

    def __init__(
        self, n: int, *, durable: bool = False, executable: str = "redis-server",
        tls: Pki | None = None, password: str | None = None,
    ) -> None:  # fmt: skip
        self.durable = durable
        self.tls = tls
        base = str(TMPFS) if durable and TMPFS.is_dir() else None
        self._dir = procs.Workdir(None, "jobfence-redlock-", parent=base)
        self._dir.make()
        self._plan = (n, executable, password)
        self._replan()

    def _replan(self) -> bool:
        """Every master described afresh, on new TLS ports."""
        n, executable, password = self._plan
        root, tls = self._dir.path, self.tls
        extra = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else []
        #: Each master's TLS port (with `tls`: its certificate from that test CA, a client
        #: certificate asked of every client); the plain port serves the harness.
        self.tls_ports = [free_port() for _ in range(n)] if tls else []
        self.servers: list[RedisServer] = [
            RedisServer(executable=executable, workdir=root / f"m{i}", password=password,
                        extra_args=[*extra, *(redis_tls_args(tls, self.tls_ports[i])
                                              if tls else [])])
            for i in range(n)
        ]
        return True

    @property
    def url(self) -> str:
        """``redlock://127.0.0.1:p1,127.0.0.1:p2,...`` (with TLS: ``redlocks://`` to the TLS
        ports, the password and the CA and client certificate options)."""
        if self.tls is None:
            return "redlock://" + ",".join(f"{s.host}:{s.port}" for s in self.servers)
        auth = f":{quote(self.servers[0].password, safe='')}@" if self.servers[0].password else ""
        hosts = ",".join(f"{s.host}:{p}" for s, p in zip(self.servers, self.tls_ports, strict=True))
        return f"redlocks://{auth}{hosts}?{tls_query(self.tls)}"

    def restart(self, index: int, *, keep_data: bool = False) -> None:
        """Crash master `index` (SIGKILL) and start it again on its port, empty unless
        `keep_data` (which keeps only what its append-only file had synced)."""
        server = self.servers[index]
        server.kill()
        if not keep_data:
            for path in server.workdir.iterdir():
                if path.name.startswith(("appendonly", "dump")):
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
        server.start()

    def lose_all_data(self) -> None:
        """Every master crashes and comes back empty."""
        for i in range(len(self.servers)):
            self.restart(i)

    def client(self, index: int) -> redis.Redis:
        return self.servers[index].client(decode_responses=True)

    def keys(self, pattern: str) -> list[list[str]]:
        """The key names matching `pattern` on each master (SCAN), skipping masters that are
        down or paused (an empty list for them)."""
        out: list[list[str]] = []
        for server in self.servers:
            if not server.running or server.paused:
                out.append([])
                continue
            client = server.client(decode_responses=True, socket_timeout=2.0)
            try:
                out.append(sorted(str(k) for k in client.scan_iter(match=pattern, count=1000)))
            finally:
                client.close()
        return out

    def __repr__(self) -> str:
        return f"<RedisMasters {self.url}{' durable' if self.durable else ''}>"
