"""A private Redis Sentinel topology (1 master, replicas, sentinels) on 127.0.0.1, for tests."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from devstack import procs
from devstack.pki import Pki, redis_tls_args, tls_query
from devstack.redis_server import HOST, RedisServer, RedisServerError, free_port

__all__ = ["LocalSentinel", "SentinelError"]

SERVICE = "jfmaster"
T = TypeVar("T")


class SentinelError(RuntimeError):
    """The topology could not be started, or did not reach the state waited for."""


@dataclass
class _Sentinel:
    port: int
    conf: Path
    log: Path
    myid: str
    server: procs.ServerProcess = field(repr=False)
    password: str | None = field(default=None, repr=False)  # its own requirepass
    tls_port: int = 0  # with TLS: what clients and the other sentinels use

    def client(self, timeout: float = 1.0) -> redis.Redis:
        """A client of its plain port (the harness's)."""
        return redis.Redis(host=HOST, port=self.port, socket_timeout=timeout,
                           socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                           decode_responses=True, password=self.password)  # fmt: skip


class LocalSentinel(procs.Launcher):
    """One master, `replicas` replicas and `sentinels` sentinels, each a child process on a
    free port of 127.0.0.1, non-persistent (data lives in memory only).

    The sentinels are told the whole topology in their config files (each other's ids, the
    replicas), so they agree on it at once instead of after the 2-10 s of hello and INFO
    rounds. ``url`` is the ``redis+sentinel://`` lock URL. Stopping is by pid, never by name.

    For fault tests, the key-loss recipe (research notes §6): ``freeze_replicas()``, write on
    the master, ``kill_master()``, ``thaw_replicas()``, ``wait_for_failover()``; a write the
    replicas never received is gone on the promoted one.
    """

    def __init__(
        self,
        *,
        service: str = SERVICE,
        replicas: int = 2,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        executable: str = "redis-server",
        tls: Pki | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        if sentinels < 1 or replicas < 0:
            raise ValueError("need at least one sentinel and a non-negative replica count")
        self.service = service
        self.quorum = sentinels // 2 + 1
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.executable = executable
        self._dir = procs.Workdir(None, "jobfence-sentinel-")
        root = self._dir.make()
        # With `tls`: every node and sentinel serves TLS on a port of its own (what the
        # sentinels name and the URL lists; replication and the sentinels' links in TLS too),
        # the plain ports serve the harness. `password`: the nodes' requirepass (the
        # sentinels are told it); `sentinel_password`: the sentinels' own.
        self.tls = tls
        self.password = password
        self.sentinel_password = sentinel_password
        self._counts = (replicas, sentinels)
        self._plan(root)

    def _plan(self, root: Path) -> None:
        """Choose every port afresh and describe the nodes and sentinels on them."""
        replicas, sentinels = self._counts
        tls, password, executable = self.tls, self.password, self.executable
        master_port = free_port()
        self.tls_ports = [free_port() for _ in range(replicas + 1)] if tls else []
        upstream = self.tls_ports[0] if tls else master_port
        self.nodes = [
            RedisServer(
                master_port if i == 0 else None,
                executable=executable,
                workdir=root / f"node{i}",
                password=password,
                # A replica syncs at once (7.0 waits 5 s for more replicas to share a sync).
                extra_args=("--repl-diskless-sync-delay", "0",
                            *(() if i == 0 else ("--replicaof", HOST, str(upstream))),
                            *(redis_tls_args(tls, self.tls_ports[i]) if tls else ())),
            )
            for i in range(replicas + 1)
        ]
        for i in range(sentinels):  # a try before this one may have left its log
            (root / f"sentinel{i}.log").unlink(missing_ok=True)
        self.sentinels = [
            _Sentinel(
                port=0,
                conf=root / f"sentinel{i}.conf",
                log=root / f"sentinel{i}.log",
                myid=secrets.token_hex(20),
                server=procs.ServerProcess(f"sentinel {i}", error=SentinelError),
                password=self.sentinel_password,
            )
            for i in range(sentinels)
        ]

    # -- addresses -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:s1,127.0.0.1:s2,.../<service>`` (with TLS,
        ``rediss+sentinel://`` to the TLS ports with the CA and client options; the
        passwords in it when set)."""
        if self.tls is None and not self.password and not self.sentinel_password:
            hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
            return f"redis+sentinel://{hosts}/{self.service}"
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{HOST}:{s.tls_port or s.port}" for s in self.sentinels)
        query = [tls_query(self.tls)] if self.tls else []
        if self.sentinel_password:
            query.append(f"sentinel_password={quote(self.sentinel_password, safe='')}")
        scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
        return f"{scheme}://{auth}{hosts}/{self.service}" + (f"?{'&'.join(query)}" if query
                                                              else "")  # fmt: skip

    def master_address(self) -> tuple[str, int] | None:
        """The master the first answering sentinel names, or None if none answers."""
        for sentinel in self.sentinels:
            if not sentinel.server.running:
                continue
            client = sentinel.client()
            try:
                addr: Any = client.sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            finally:
                client.close()
            if addr:
                return str(addr[0]), int(addr[1])
        return None

    def node_at(self, port: int) -> RedisServer:
        """The node listening on `port` (its plain or its TLS port)."""
        for i, node in enumerate(self.nodes):
            if node.port == port or (self.tls_ports and self.tls_ports[i] == port):
                return node
        raise SentinelError(f"no node of this topology listens on port {port}")

    def master(self) -> RedisServer:
        """The node the sentinels name as master now."""
        addr = self.master_address()
        if addr is None:
            raise SentinelError("no sentinel answers")
        return self.node_at(addr[1])

    def replicas(self) -> list[RedisServer]:
        master = self.master()
        return [n for n in self.nodes if n is not master]

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 20.0, attempts: int = 5) -> Self:
        """Start every node and sentinel and wait until the topology settles. Ports are
        chosen free a moment before use; if another process binds one first (a client's
        ephemeral port, say), every process is stopped and the start tried on new ports."""
        for attempt in range(attempts):
            try:
                for node in self.nodes:
                    node.start()
                self._start_sentinels(self.tls_ports[0] if self.tls else self.nodes[0].port)
                self.wait_ready(timeout)
                return self
            except (RedisServerError, SentinelError) as exc:
                if attempt + 1 < attempts and "Address already in use" in str(exc):
                    self._stop_processes()
                    self._plan(self._dir.path)
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start_sentinels(self, master_port: int) -> None:
        for sentinel in self.sentinels:
            sentinel.port = free_port()
            sentinel.tls_port = free_port() if self.tls else 0
        for sentinel in self.sentinels:
            self._write_conf(sentinel, master_port)
            sentinel.server.what = f"sentinel on port {sentinel.port}"
            sentinel.server.spawn([self.executable, str(sentinel.conf), "--sentinel"],
                                  log_path=sentinel.log.with_suffix(".stdio"))  # fmt: skip

    def _write_conf(self, sentinel: _Sentinel, master_port: int) -> None:
        name = self.service
        lines = [
            f"port {sentinel.port}",
            f"bind {HOST}",
            "daemonize no",
            f"dir {self._dir.path}",
            f"logfile {sentinel.log}",
            f"sentinel myid {sentinel.myid}",
            f"sentinel monitor {name} {HOST} {master_port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
            *(f"sentinel known-replica {name} {HOST} {p}"
              for p in (self.tls_ports or [n.port for n in self.nodes])[1:]),
            *(f"sentinel known-sentinel {name} {HOST} {o.tls_port or o.port} {o.myid}"
              for o in self.sentinels if o is not sentinel),
            *([f"sentinel auth-pass {name} {self.password}"] if self.password else []),
            *([f"requirepass {self.sentinel_password}"] if self.sentinel_password else []),
        ]  # fmt: skip
        if self.tls is not None:  # redis-server's TLS arguments, as config lines
            args = redis_tls_args(self.tls, sentinel.tls_port)
            lines += [f"{k.removeprefix('--')} {v}" for k, v in zip(args[::2], args[1::2],
                                                                     strict=True)]  # fmt: skip
        sentinel.conf.write_text("\n".join(lines) + "\n")

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until every sentinel answers, names a master that answers as one, and counts
        every other node as its connected replica and every other sentinel."""
        want_replicas = len(self.nodes) - 1
        want_peers = len(self.sentinels) - 1

        def ready() -> bool:
            addr = None
            for sentinel in self.sentinels:
                if not sentinel.server.running:
                    raise SentinelError(f"sentinel on port {sentinel.port} exited\n"
                                        f"{procs.tail(sentinel.log)}")  # fmt: skip
                client = sentinel.client()
                try:
                    state: Any = client.sentinel_master(self.service)
                except redis.RedisError:
                    return False
                finally:
                    client.close()
                if state.get("num-other-sentinels") != want_peers:
                    return False
                if not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
                    return False
                here = (state["ip"], int(state["port"]))
                if addr is not None and here != addr:
                    return False
                addr = here
            assert addr is not None
            master = self.node_at(addr[1]).client(socket_timeout=1.0, decode_responses=True)
            try:
                info = master.info("replication")
            except redis.RedisError:
                return False
            links = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            online = [v for v in links if v.get("state") == "online"]
            return info.get("role") == "master" and len(online) == want_replicas

        self._poll(ready, timeout, "the Sentinel topology did not settle")

    def _poll(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() >= deadline:
                raise SentinelError(f"{what} within {timeout:g}s\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every sentinel and node this object started (by pid) and delete its files."""
        self._stop_processes()
        self._dir.remove()

    def _stop_processes(self) -> None:
        for sentinel in self.sentinels:
            sentinel.server.stop(5)
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    def log_tail(self, lines: int = 15) -> str:
        parts = [f"--- sentinel {s.port} ---\n{procs.tail(s.log, lines)}" for s in self.sentinels]
        for node in self.nodes:
            with contextlib.suppress(RuntimeError):  # never started
                parts.append(f"--- node {node.port} ---\n{procs.tail(node.log_path, lines)}")
        return "\n".join(parts)

    # -- faults ----------------------------------------------------------------------

    def freeze_replicas(self) -> list[RedisServer]:
        """SIGSTOP every replica of the current master; returns them (for `thaw_replicas`)."""
        frozen = self.replicas()
        for node in frozen:
            node.pause()
        # SIGSTOP lands asynchronously: wait until the kernel shows each one stopped.
        self._poll(lambda: all(procs.proc_state(n.pid) in ("T", "t") for n in frozen), 5.0,
                   "a replica did not stop")  # fmt: skip
        return frozen

    def thaw_replicas(self) -> None:
        """SIGCONT every paused node."""
        for node in self.nodes:
            if node.paused:
                node.resume()

    def cut_replication(self) -> None:
        """Close the master's links to its replicas (CLIENT KILL TYPE replica): with them
        frozen, nothing written on the master from now on reaches them, not even what the
        kernel would have buffered for a stopped process."""
        client = self.master().client(socket_timeout=2.0)
        try:
            client.client_kill_filter(_type="slave")
        finally:
            client.close()

    def kill_master(self) -> RedisServer:
        """SIGKILL the current master (a crash); returns it."""
        master = self.master()
        master.kill()
        return master

    def wait_for_failover(self, old: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Until the sentinels name another node as master and it answers as a master."""
        def promoted() -> bool:
            addr = self.master_address()
            if addr is None or addr[1] == old.port:
                return False
            client = self.node_at(addr[1]).client(socket_timeout=1.0, decode_responses=True)
            try:
                return bool(client.info("replication").get("role") == "master")
            except redis.RedisError:
                return False
            finally:
                client.close()

        self._poll(promoted, timeout, "no replica was promoted")
        return self.master()

    def failover_losing(self, write: Callable[[], T], timeout: float = 30.0) -> T:
        """Run `write` on a master whose replicas never get it, then crash the master and
        wait until a replica is promoted without it; returns what `write` returned.

        The recipe of the research notes §6: replicas frozen (SIGSTOP) and cut off, the
        write, the master killed (SIGKILL), the replicas resumed (SIGCONT) within the
        sentinels' down-after time, so they stay eligible and the failover takes ~3 s.
        """
        self.freeze_replicas()
        try:
            self.cut_replication()
            result = write()
        finally:
            old = self.kill_master()
            self.thaw_replicas()
        self.wait_for_failover(old, timeout)
        return result

    def rejoin(self, node: RedisServer, timeout: float = 30.0) -> None:
        """Make `node` a replica of the current master again: started anew (empty) if it
        was killed; if it lives on as a deposed master, told at once what the sentinels
        would tell it at their next 10 s INFO round. Returns once the topology is whole."""
        master = self.master()
        try:
            node.start()  # a no-op while it runs
        except RedisServerError as exc:
            raise SentinelError(f"node {node.port} did not come back: {exc}") from exc
        client = node.client(socket_timeout=2.0)
        try:
            port = self.tls_ports[self.nodes.index(master)] if self.tls else master.port
            client.replicaof(HOST, port)
        finally:
            client.close()
        self.wait_ready(timeout)

    def __repr__(self) -> str:
        return f"<LocalSentinel {self.url}>"
