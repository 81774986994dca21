"""A user's Django TestCase suite (tests/django_project/shop/tests.py) run by ``manage.py test``
on real PostgreSQL and Redis, twice: the tests reuse one payment id, and each starts clean
(a rolled-back test leaves no job record on the lock server to answer the next one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.redis_server import RedisServer
from tests.servers import POSTGRES_ADMIN_URL, PostgresDatabase

pytest.importorskip("django")

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_shops_testcase_suite_passes_twice_against_one_lock_server(redis_url: str) -> None:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBFENCE_")}
    with PostgresDatabase() as db:
        env.update(
            DJANGO_SETTINGS_MODULE="tests.django_project.settings",
            SHOP_DB_NAME=db.name,  # manage.py test makes and drops test_<name> beside it
            SHOP_BROKER_URL="memory://localhost/",
            SHOP_LOCK_URL=redis_url,
        )
        for run in (1, 2):
            done = subprocess.run(
                [sys.executable, "-m", "tests.django_project.manage", "test",
                 "tests.django_project.shop.tests", "--noinput"],
                env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            assert done.returncode == 0, f"run {run}:\n{done.stderr[-4000:]}"
            assert "Ran 3 tests" in done.stderr


def test_a_testcase_with_jobfence_testing_passes_twice_writing_nothing_to_the_lock_server(
    fresh_redis: RedisServer,
) -> None:
    reason = PostgresDatabase.reachable(POSTGRES_ADMIN_URL)
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBFENCE_")}
    with PostgresDatabase() as db:
        env.update(
            DJANGO_SETTINGS_MODULE="tests.django_project.settings",
            SHOP_DB_NAME=db.name,
            SHOP_BROKER_URL="memory://localhost/",
            SHOP_LOCK_URL=fresh_redis.url,  # configured, and never written to
        )
        for run in (1, 2):
            done = subprocess.run(
                [sys.executable, "-m", "tests.django_project.manage", "test",
                 "tests.django_project.shop.tests_jobfence", "--noinput"],
                env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            assert done.returncode == 0, f"run {run}:\n{done.stderr[-4000:]}"
            assert "Ran 5 tests" in done.stderr
    client = fresh_redis.client()
    try:
        assert client.dbsize() == 0, sorted(client.keys("*"))[:10]
    finally:
        client.close()
