"""Loopback cluster seeds whose CLUSTER SLOTS names a node elsewhere: judged by the node."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from devstack.redis_server import HOST, RedisServer, free_port
from devstack.servers import wait_for
from jobfence.config.errors import UnsafeSettings
from jobfence.config.settings import Settings
from jobfence.locks.backends.redis.cluster import RedisClusterBackend

PASSWORD = "cluster-pw-not-to-leak-5c1e"
SECRET = "a-real-random-secret-0123456789abcdef"


def _remote_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: picks the outgoing address
        return str(s.getsockname()[0])


@pytest.fixture(scope="module")
def remote_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A one-node cluster listening on loopback and on this host's other address, which it
    announces: CLUSTER SLOTS names the non-loopback address."""
    addr = _remote_address()
    if addr.startswith("127."):
        pytest.skip("this host has no address other than loopback")
    workdir = tmp_path_factory.mktemp("cluster")
    server = RedisServer(
        bind=(HOST, addr), password=PASSWORD, workdir=workdir,
        extra_args=["--cluster-enabled", "yes", "--cluster-config-file",
                    str(workdir / "nodes.conf"), "--cluster-announce-ip", addr,
                    # Its own bus port: the default (port + 10000) may be above 65535.
                    "--cluster-port", str(free_port())],
    ).start()  # fmt: skip
    try:
        c: Any = redis.Redis(host=HOST, port=server.port, password=PASSWORD, decode_responses=True)
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_for(lambda: "cluster_state:ok" in c.execute_command("CLUSTER", "INFO"), 15,
                 message="the one-node cluster did not form")  # fmt: skip
        c.close()
        yield addr, server.port
    finally:
        server.stop()


def _url(port: int) -> str:
    return f"redis+cluster://:{PASSWORD}@{HOST}:{port}"


def test_the_url_judgement_alone_accepts_loopback_seeds(remote_node: tuple[str, int]) -> None:
    """Control: judged by the URL's hosts (the seeds), nothing is found."""
    _, port = remote_node
    s = Settings(lock_url=_url(port), key_secret=SECRET)
    assert [d for d in s.downgrades() if d.variable == "JOBFENCE_LOCK_URL"] == []


def test_a_remote_node_in_cluster_slots_is_refused(
    remote_node: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    addr, port = remote_node
    monkeypatch.delenv("JOBFENCE_ALLOW_INSECURE", raising=False)
    with pytest.raises(UnsafeSettings) as caught:
        backend = RedisClusterBackend.from_url(_url(port), prefix="remote")
        try:
            backend.cluster.set("remote-probe", "1")
        finally:
            backend.close()
    text = str(caught.value)
    assert f"{addr}:{port}" in text and "cleartext" in text and "JOBFENCE_ALLOW_INSECURE" in text
    assert PASSWORD not in text


def test_allow_insecure_cleartext_lets_the_remote_node_serve(
    remote_node: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, port = remote_node
    monkeypatch.setenv("JOBFENCE_ALLOW_INSECURE", "cleartext")
    backend = RedisClusterBackend.from_url(_url(port), prefix="remote")
    try:
        assert backend.cluster.set("remote-probe", "1")
    finally:
        backend.close()


def test_a_remote_node_is_refused_to_the_asyncio_store_too(
    remote_node: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asyncio twin builds a cluster client of its own: it judges every node as well."""
    import asyncio

    from jobfence.locks.backends.redis.cluster_async import AsyncClusterStore

    addr, port = remote_node
    monkeypatch.setenv("JOBFENCE_ALLOW_INSECURE", "cleartext")  # the sync twin's start-up
    store = AsyncClusterStore.from_url(_url(port), prefix="remote")
    monkeypatch.delenv("JOBFENCE_ALLOW_INSECURE")

    async def probe() -> None:
        try:
            await store.client.set("remote-probe", "1")
        finally:
            await store.aclose()

    with pytest.raises(UnsafeSettings) as caught:
        asyncio.run(probe())
    assert f"{addr}:{port}" in str(caught.value) and PASSWORD not in str(caught.value)
