"""Fixtures for fault tests: a reply-dropping proxy, a network namespace, a stepped server clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults import clock, netns
from tests.faults.clock import ServerClock
from tests.faults.netns import NetNamespace
from tests.proxy import FaultProxy
from tests.servers import RedisServer


@pytest.fixture
def fault_proxy(fresh_redis: RedisServer) -> Iterator[FaultProxy]:
    """A FaultProxy in front of this test's own redis-server (``fresh_redis``)."""
    with FaultProxy(fresh_redis.host, fresh_redis.port) as proxy:
        yield proxy


@pytest.fixture
def net_namespace() -> Iterator[NetNamespace]:
    """A network namespace with a veth link to the host; skipped where one cannot be made."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    try:
        ns = NetNamespace.create()
    except netns.NetnsError as exc:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(f"cannot create a network namespace here: {exc}")
    with ns:
        yield ns


@pytest.fixture
def server_clock(tmp_path: Path) -> ServerClock:
    """The wall-clock offset of `stepped_redis` (0 until the test steps it)."""
    reason = clock.unavailable()
    if reason is not None:
        pytest.skip(reason)
    return ServerClock(tmp_path / "faketime.rc")


@pytest.fixture
def stepped_redis(server_clock: ServerClock, tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server running under libfaketime, its wall clock set by `server_clock`."""
    with RedisServer(env=server_clock.env(), workdir=tmp_path / "stepped-redis") as server:
        yield server
