"""A loopback sentinel naming a master on another host: judged by the master's address."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devstack.redis_server import HOST, RedisServer, free_port
from devstack.servers import wait_for
from jobfence.config.errors import UnsafeSettings
from jobfence.config.security import refuse_node
from jobfence.config.settings import Settings
from jobfence.locks.backend import Security
from jobfence.locks.backends.redis.sentinel import RedisSentinelBackend

PASSWORD = "master-pw-not-to-leak-7f3a"
SECRET = "a-real-random-secret-0123456789abcdef"


def _remote_address() -> str:
    """This host's own address that is not loopback (the master listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: picks the outgoing address
        return str(s.getsockname()[0])


@pytest.fixture(scope="module")
def remote_topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A master bound to a non-loopback address of this host, with a password, and one
    sentinel on loopback naming it; yields (the sentinel URL's address, master port)."""
    addr = _remote_address()
    if addr.startswith("127."):
        pytest.skip("this host has no address other than loopback")
    master = RedisServer(bind=(addr,), password=PASSWORD).start()
    workdir: Path = tmp_path_factory.mktemp("sentinel")
    port = free_port()
    conf = workdir / "sentinel.conf"
    conf.write_text("\n".join([
        f"port {port}", f"bind {HOST}", f"dir {workdir}",
        f"sentinel monitor svc {addr} {master.port} 1",
        "sentinel down-after-milliseconds svc 60000",
        f"sentinel auth-pass svc {PASSWORD}",
    ]) + "\n")  # fmt: skip
    proc = subprocess.Popen(["redis-server", str(conf), "--sentinel"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        probe = redis.Redis(host=HOST, port=port, decode_responses=True)

        def named() -> bool:
            try:
                return bool(probe.sentinel_get_master_addr_by_name("svc"))
            except redis.RedisError:
                return False

        wait_for(named, 15, message="the sentinel did not start")
        probe.close()
        yield addr, port
    finally:
        proc.terminate()
        proc.wait(10)
        master.stop()


def _url(port: int) -> str:
    return f"redis+sentinel://:{PASSWORD}@{HOST}:{port}/svc/0"


def test_the_url_judgement_alone_accepts_a_loopback_sentinel(
    remote_topology: tuple[str, int],
) -> None:
    """Control: judged by the URL's hosts (the sentinels), nothing is found, and the old
    backend sent the master its password in clear text."""
    _, port = remote_topology
    s = Settings(lock_url=_url(port), key_secret=SECRET)
    assert [d for d in s.downgrades() if d.variable == "JOBFENCE_LOCK_URL"] == []


def test_a_remote_master_named_by_a_loopback_sentinel_is_refused(
    remote_topology: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    addr, port = remote_topology
    monkeypatch.delenv("JOBFENCE_ALLOW_INSECURE", raising=False)
    backend = RedisSentinelBackend.from_url(_url(port), prefix="remote")
    try:
        with pytest.raises(UnsafeSettings) as caught:
            backend.client.ping()
        text = str(caught.value)
        assert f"{addr}:" in text and "cleartext" in text and "JOBFENCE_ALLOW_INSECURE" in text
        assert PASSWORD not in text
    finally:
        backend.close()


def test_a_remote_master_is_refused_to_the_asyncio_store_too(
    remote_topology: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asyncio twin asks its own Sentinel client for the master at each new connection:
    it judges the master the same way, before the login."""
    import asyncio

    from jobfence.locks.backends.redis.sentinel_async import AsyncSentinelStore

    addr, _ = remote_topology
    _, port = remote_topology
    monkeypatch.delenv("JOBFENCE_ALLOW_INSECURE", raising=False)
    store = AsyncSentinelStore.from_url(_url(port), prefix="remote")

    async def probe() -> None:
        try:
            await store.client.ping()
        finally:
            await store.aclose()

    with pytest.raises(UnsafeSettings) as caught:
        asyncio.run(probe())
    assert f"{addr}:" in str(caught.value) and PASSWORD not in str(caught.value)


def test_allow_insecure_cleartext_lets_the_remote_master_serve(
    remote_topology: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, port = remote_topology
    monkeypatch.setenv("JOBFENCE_ALLOW_INSECURE", "cleartext")
    backend = RedisSentinelBackend.from_url(_url(port), prefix="remote")
    try:
        assert backend.client.ping()
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("found", "item"),
    [
        (Security(tls=False, verified=False, hostname_checked=False, auth=True), "cleartext"),
        (Security(tls=True, verified=False, hostname_checked=False, auth=True), "unverified-tls"),
        (Security(tls=True, verified=True, hostname_checked=True, auth=False), "no-auth"),
    ],
)
def test_a_data_node_is_judged_by_its_own_address(found: Security, item: str) -> None:
    with pytest.raises(UnsafeSettings) as caught:
        refuse_node(found, ("10.1.2.3", 6379), "Sentinel master", allowed=())
    assert "10.1.2.3:6379" in str(caught.value) and f"JOBFENCE_ALLOW_INSECURE={item}" in str(
        caught.value
    )
    refuse_node(found, ("10.1.2.3", 6379), "Sentinel master", allowed=(item,))
    refuse_node(found, ("127.0.0.1", 6379), "Sentinel master", allowed=())
