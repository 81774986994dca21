"""Fixtures for the workflow tests: each test on SQLite and on PostgreSQL, with an eager app."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from jobfence.tasks import runtime_for
from tests.workflows import eager_app


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A private ledger database: an SQLite file, or a fresh schema on the session's server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite'}"
        return
    if request.param == "mariadb":
        yield from _mariadb_schema(request.getfixturevalue("mariadb_url"))
        return
    pg_url: str = request.getfixturevalue("pg_url")
    schema = f"wf_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(pg_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def app(redis_url: str, database_url: str) -> Iterator[Celery]:
    """An eager Celery app whose runtime locks on the test's Redis and writes the test's ledger."""
    app = eager_app(redis_url, database_url)
    yield app
    runtime_for(app).close()


def _mariadb_schema(server_url: str) -> Iterator[str]:
    name = f"wf_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()
