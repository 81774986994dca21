"""Private ZooKeeper servers (one standalone, or a 3-node ensemble) as child Java processes."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from devstack import procs
from devstack.redis_server import HOST, free_port

__all__ = [
    "ZOOKEEPER_JAR",
    "ZooKeeperEnsemble",
    "ZooKeeperError",
    "ZooKeeperServer",
    "ZooKeeperTls",
    "four_letter_word",
    "unavailable",
]

# Debian's libzookeeper-java: the jar's manifest pulls its other jars (netty, jetty, slf4j-api)
# from /usr/share/java; a logging binding and log4j 1.2 are added here.
ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
LOG_JARS = ("/usr/share/java/slf4j-log4j12.jar", "/usr/share/java/log4j-1.2.jar")
# The TLS client port is Netty's (NettyServerCnxnFactory); the jar's manifest names netty's
# handler but not the codec its SslHandler extends (NoClassDefFoundError ByteToMessageDecoder
# at the first connection) nor the resolver. Both are Debian's libnetty-java, a dependency
# of libzookeeper-java.
NETTY_JARS = ("/usr/share/java/netty-codec.jar", "/usr/share/java/netty-resolver.jar")
CLIENT_AUTH = ("need", "want", "none")
JVM_OPTIONS = ("-Xmx256m", "-XX:+UseSerialGC", "-Xss512k")
LOG4J = """\
log4j.rootLogger=WARN, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p [%t] %c{1}: %m%n
"""


class ZooKeeperError(RuntimeError):
    """A private ZooKeeper server could not be started or asked."""


@dataclass(frozen=True)
class ZooKeeperTls:
    """A TLS client port's PEM files: the server's certificate and its PKCS#8 key (joined
    into ZooKeeper's PEM key store), the CA whose client certificates it trusts, and
    `client_auth`, ZooKeeper's ssl.clientAuth: `need` (a client certificate from `ca` is
    required), `want` (checked if sent) or `none`."""

    cert: Path
    key: Path
    ca: Path
    client_auth: str = "need"

    def __post_init__(self) -> None:
        if self.client_auth not in CLIENT_AUTH:
            raise ValueError(
                f"ZooKeeperTls client_auth={self.client_auth!r}: give one of {CLIENT_AUTH}"
            )


def unavailable(java: str = "java", *, tls: bool = False) -> str | None:
    """None if a private server can be started here, else why not (for pytest.skip);
    `tls`: with a TLS client port (Netty's jars)."""
    if shutil.which(java) is None:
        return f"`{java}` not found: install a JRE (./.ci/setup installs default-jre-headless)"
    for jar in (ZOOKEEPER_JAR, *LOG_JARS, *(NETTY_JARS if tls else ())):
        if not Path(jar).exists():
            return f"{jar} not found: install libzookeeper-java (./.ci/setup does)"
    return None


def four_letter_word(host: str, port: int, word: str = "srvr", timeout: float = 1.0) -> str:
    """Send a four-letter admin command (srvr, ruok, mntr) and return the whole answer."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(word.encode())
        chunks = []
        while True:
            data = sock.recv(4096)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def _mode(answer: str) -> str | None:
    """`standalone`, `leader` or `follower` from a srvr answer, None if not serving yet."""
    for line in answer.splitlines():
        if line.startswith("Mode: "):
            return line.split(":", 1)[1].strip()
    return None


class ZooKeeperServer(procs.SingleServer):
    """One ZooKeeper server, a child process of this one; standalone unless given `peers`.

        with ZooKeeperServer() as zk:
            backend = open_backend(zk.url)

    Its files (config, log, data) live in `workdir` if given (kept), else in a temporary
    directory removed by `stop()`. `restart()` keeps the data directory, `restart(fresh=True)`
    empties it first (a lost disk); the ports stay. Settings fit tests: tickTime 500 ms, so
    sessions of 1-60 s are granted as asked; the transaction log is still fsynced.

    For fault tests: `listen` is the address the client port binds (a veth address, say);
    `prefix_command` runs the JVM under a wrapper (``ip netns exec NAME``).

    With `tls` (a ZooKeeperTls) it also serves a TLS client port, `secure_port` (ZooKeeper's
    secureClientPort, on `listen`, served by Netty); the plain port stays open for the
    harness (`srvr`), which a production server would close by leaving clientPort out.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        listen: str = HOST,
        workdir: str | os.PathLike[str] | None = None,
        tick_ms: int = 500,
        min_session_ms: int = 1000,
        max_session_ms: int = 60000,
        startup_timeout: float = 30.0,
        java: str = "java",
        jvm_options: Sequence[str] = JVM_OPTIONS,
        prefix_command: Sequence[str] = (),
        peers: Sequence[tuple[int, int, int]] = (),
        myid: int = 0,
        tls: ZooKeeperTls | None = None,
        secure_port: int | None = None,
    ) -> None:
        self._port = port
        self.tls = tls
        self._secure_port = secure_port
        self.listen = listen
        self._dir = procs.Workdir(workdir, "jobfence-zk-")
        self.tick_ms = tick_ms
        self.min_session_ms = min_session_ms
        self.max_session_ms = max_session_ms
        self.startup_timeout = startup_timeout
        self.java = java
        self.jvm_options = tuple(jvm_options)
        self.prefix_command = tuple(prefix_command)
        self.peers = tuple(peers)  # (myid, peer port, election port) of every member
        self.myid = myid
        self._server = procs.ServerProcess("ZooKeeper", error=ZooKeeperError)

    # -- properties -------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("ZooKeeperServer has not been started yet")
        return self._port

    @property
    def address(self) -> str:
        """host:port of the client port."""
        return f"{self.listen}:{self.port}"

    @property
    def secure_port(self) -> int:
        """The TLS client port (secureClientPort); only with `tls`."""
        if self.tls is None:
            raise RuntimeError("this ZooKeeperServer has no TLS port: pass tls=ZooKeeperTls(...)")
        if self._secure_port is None:
            raise RuntimeError("ZooKeeperServer has not been started yet")
        return self._secure_port

    @property
    def secure_address(self) -> str:
        """host:port of the TLS client port."""
        return f"{self.listen}:{self.secure_port}"

    @property
    def url(self) -> str:
        return f"zookeeper://{self.address}"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def log_path(self) -> Path:
        return self.workdir / "zookeeper.out"

    def log_tail(self, lines: int = 40) -> str:
        if not self._dir.made:
            return "<not started>"
        return f"--- {self.log_path} ---\n{procs.tail(self.log_path, lines)}"

    def srvr(self, timeout: float = 1.0) -> str:
        """The server's answer to `srvr` (version, zxid, mode, ...)."""
        return four_letter_word(self.listen, self.port, "srvr", timeout)

    def mode(self) -> str | None:
        """`standalone`, `leader` or `follower`; None while not serving (or unreachable)."""
        try:
            return _mode(self.srvr())
        except OSError:
            return None

    # -- configuration ------------------------------------------------------------------
    def _config(self) -> str:
        lines = [
            f"tickTime={self.tick_ms}",
            f"dataDir={self.data_dir}",
            f"clientPort={self.port}",
            f"clientPortAddress={self.listen}",
            f"minSessionTimeout={self.min_session_ms}",
            f"maxSessionTimeout={self.max_session_ms}",
            "admin.enableServer=false",  # else Jetty takes port 8080
            "4lw.commands.whitelist=srvr,ruok,mntr,stat,conf",
            "preAllocSize=1024",  # KB per transaction log file (64 MB by default)
            "autopurge.purgeInterval=0",
            "maxClientCnxns=0",  # tests race dozens of processes from one address
        ]
        if self.peers:
            lines += ["initLimit=10", "syncLimit=5", "cnxTimeout=500"]
            lines += [f"server.{i}={HOST}:{p}:{e}" for i, p, e in self.peers]
        if self.tls is not None:
            # Keys ZooKeeper does not know become zookeeper.* system properties, which is
            # where its X509Util reads ssl.*; PEM stores need 3.7 or later.
            lines += [
                f"secureClientPort={self.secure_port}",
                f"secureClientPortAddress={self.listen}",
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                f"ssl.keyStore.location={self._keystore}",
                "ssl.keyStore.type=PEM",
                f"ssl.trustStore.location={self.tls.ca}",
                "ssl.trustStore.type=PEM",
                f"ssl.clientAuth={self.tls.client_auth}",
            ]
        return "\n".join(lines) + "\n"

    @property
    def _keystore(self) -> Path:
        return self.workdir / "keystore.pem"

    def _command(self) -> list[str]:
        cfg = self.workdir / "zoo.cfg"
        return [
            *self.prefix_command,
            self.java,
            *self.jvm_options,
            f"-Dzookeeper.log.dir={self.workdir}",
            f"-Dlog4j.configuration=file:{self.workdir / 'log4j.properties'}",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp",
            ":".join((ZOOKEEPER_JAR, *LOG_JARS, *(NETTY_JARS if self.tls else ()))),
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(cfg),
        ]

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, *, wait: bool = True) -> Self:
        """Start the JVM and (with `wait`) return once `srvr` reports a mode; idempotent."""
        if self.running:
            return self
        reason = unavailable(self.java, tls=self.tls is not None)
        if reason is not None:
            raise ZooKeeperError(reason)
        self._dir.make()
        if self._port is None:
            self._port = free_port(self.listen)
        if self.tls is not None:
            while self._secure_port in (None, self._port):
                self._secure_port = free_port(self.listen)
            # ZooKeeper's PEM key store: the private key and the certificate chain, one file.
            self._keystore.write_text(self.tls.key.read_text() + self.tls.cert.read_text())
            self._keystore.chmod(0o600)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.peers:
            (self.data_dir / "myid").write_text(f"{self.myid}\n")
        (self.workdir / "zoo.cfg").write_text(self._config())
        (self.workdir / "log4j.properties").write_text(LOG4J)
        self._spawn()
        if wait:
            self.wait_serving()
        return self

    def _spawn(self) -> None:
        self._server.what = f"ZooKeeper on {self.address}"
        self._server.spawn(self._command(), log_path=self.log_path, cwd=self.workdir)

    def wait_serving(self, timeout: float | None = None) -> str:
        """Wait until `srvr` shows a mode (`ruok` answers earlier, before it serves)."""
        self._server.wait_ready(
            lambda: self.mode() is not None,
            self.startup_timeout if timeout is None else timeout,
            interval=0.02,
        )
        return self.mode() or "unknown"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after `timeout`), reap, and remove the temp dir if it is ours."""
        self._server.stop(timeout)
        self._dir.remove()

    def restart(self, *, fresh: bool = False) -> Self:
        """Kill and start again on the same port; `fresh` empties the data directory first."""
        self.kill()
        if fresh and self._dir.made:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return self.start()

    def pause(self) -> None:
        """SIGSTOP the JVM and return once every thread of it has stopped: connections stay
        open, nothing is answered, no session expires."""
        self._server.pause()
        tasks = Path(f"/proc/{self.pid}/task")
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                states = [procs.proc_state(int(t.name)) for t in tasks.iterdir()]
            except OSError:  # it died
                return
            if all(state in ("T", "t", None) for state in states):
                return
            time.sleep(0.001)

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.running else "stopped")
        return f"<ZooKeeperServer {self.listen}:{self._port} {state}>"


class ZooKeeperEnsemble(procs.Launcher):
    """`size` servers on 127.0.0.1 forming one ensemble (quorum size // 2 + 1).

        with ZooKeeperEnsemble() as ens:
            backend = open_backend(ens.url)
            ens.leader().kill()
    """

    def __init__(
        self,
        size: int = 3,
        *,
        workdir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 60.0,
        **options: Any,
    ) -> None:
        if size < 3 or size % 2 == 0:
            raise ValueError(f"an ensemble needs an odd size of at least 3, got {size}")
        self._dir = procs.Workdir(workdir, "jobfence-zk-ensemble-")
        root = self._dir.make()
        ports = _free_ports(3 * size)
        peers = [(i + 1, ports[3 * i + 1], ports[3 * i + 2]) for i in range(size)]
        self.startup_timeout = startup_timeout
        self.servers = [
            ZooKeeperServer(
                ports[3 * i],
                workdir=root / f"zk{i + 1}",
                peers=peers,
                myid=i + 1,
                startup_timeout=startup_timeout,
                **options,
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return "zookeeper://" + ",".join(s.address for s in self.servers)

    def start(self) -> Self:
        """Start every member, then wait until each serves (one leader, the rest followers)."""
        for server in self.servers:
            server.start(wait=False)
        for server in self.servers:
            server.wait_serving(self.startup_timeout)
        return self

    def modes(self) -> dict[int, str | None]:
        return {s.myid: s.mode() for s in self.servers if s.running}

    def leader(self, timeout: float = 30.0) -> ZooKeeperServer:
        """The member that reports Mode: leader (waits through an election)."""
        deadline = time.monotonic() + timeout
        while True:
            for server in self.servers:
                if server.running and server.mode() == "leader":
                    return server
            if time.monotonic() >= deadline:
                raise ZooKeeperError(f"no leader within {timeout:.0f}s: {self.modes()}")
            time.sleep(0.02)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self._dir.remove()

    def __iter__(self) -> Iterator[ZooKeeperServer]:
        return iter(self.servers)


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (held open together while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
