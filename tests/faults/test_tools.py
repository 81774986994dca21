"""The fault tools themselves: the proxy drops replies after execution, the partition cuts and
heals, the stepped clock moves the server's TIME. A fault test is only as good as its fault."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import redis

from tests.faults.clock import ServerClock
from tests.faults.netns import NetNamespace
from tests.proxy import FaultProxy, command
from tests.servers import ProcessGroup, RedisServer, wait_for

pytestmark = pytest.mark.fault


def test_proxy_passes_traffic_through(fault_proxy: FaultProxy) -> None:
    client = fault_proxy.client()
    try:
        client.set("k", "v")
        pipe = client.pipeline(transaction=False)
        for _i in range(50):
            pipe.incr("n")
            pipe.get("k")
        replies = pipe.execute()
        assert replies[-2:] == [50, b"v"]
    finally:
        client.close()


def test_dropped_reply_was_executed(fresh_redis: RedisServer, fault_proxy: FaultProxy) -> None:
    rule = fault_proxy.drop_reply(match=command("INCRBY", "counter"))
    client = fault_proxy.client(socket_timeout=0.3)
    try:
        with pytest.raises(redis.TimeoutError):
            client.incr("counter")
        assert rule.fired.is_set()
        assert fresh_redis.client().get("counter") == b"1"  # the server ran it
        assert client.incr("counter") == 2  # one use only; the client reconnected
    finally:
        client.close()


def test_delayed_reply_arrives_late(fault_proxy: FaultProxy) -> None:
    fault_proxy.delay_reply(0.3, match=command("PING"))
    client = fault_proxy.client()
    try:
        started = time.monotonic()
        assert client.ping()
        assert time.monotonic() - started >= 0.3
    finally:
        client.close()


def test_reset_after_reply(fresh_redis: RedisServer, fault_proxy: FaultProxy) -> None:
    fault_proxy.reset_after_reply(match=command("SET"))
    client = fault_proxy.client()
    try:
        with pytest.raises(redis.ConnectionError):
            client.set("k", "v")
        assert fresh_redis.client().get("k") == b"v"
    finally:
        client.close()


def test_cut_holds_traffic_until_restored(fault_proxy: FaultProxy) -> None:
    client = fault_proxy.client(socket_timeout=0.3)
    try:
        assert client.ping()
        with fault_proxy.partitioned(), pytest.raises(redis.TimeoutError):
            client.ping()
        assert client.ping()
    finally:
        client.close()


def test_partition_cuts_and_heals(net_namespace: NetNamespace) -> None:
    ns = net_namespace
    with RedisServer(bind=(ns.host_address, "127.0.0.1")) as server, ProcessGroup() as group:

        def connect_from_inside() -> int:
            """Exit code of a TCP connect (1 s timeout) from inside the namespace."""
            proc = group.spawn([
                *ns.exec_prefix, sys.executable, "-c",
                "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)",
                ns.host_address, str(server.port),
            ])  # fmt: skip
            wait_for(lambda: proc.poll() is not None, 20, message="probe did not exit")
            return proc.returncode

        assert connect_from_inside() == 0
        ns.cut()
        assert connect_from_inside() != 0
        # Only the veth link is cut: the host reaches the server as before.
        with socket.create_connection(("127.0.0.1", server.port), 1):
            pass
        ns.heal()
        assert connect_from_inside() == 0


def test_server_clock_steps(server_clock: ServerClock, stepped_redis: RedisServer) -> None:
    client = stepped_redis.client()

    def skew() -> float:
        secs, micros = client.time()
        return secs + micros / 1e6 - time.time()

    assert abs(skew()) < 5
    server_clock.step(3600)
    assert abs(skew() - 3600) < 5
    server_clock.step(-7200)
    assert abs(skew() + 3600) < 5
    client.set("k", "v", px=60_000)
    server_clock.set_offset(0)  # an hour forward: the key's expiry is long past
    assert client.get("k") is None
