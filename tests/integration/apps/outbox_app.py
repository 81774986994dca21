"""The fleet of the publish-on-commit storm: `outbox.fulfil` (jobfence, published through the
outbox) and `naive.fulfil` (plain Celery, published after the commit as Celery's
`delay_on_commit` does), each recording one row per run of its body.

Variables: those of :mod:`tests.integration.apps.common`, plus ``LOCK_URL`` (the jobfence
lock server) and ``DATABASE_URL`` (PostgreSQL: the orders, the outbox, the fulfilments).
The workers run the outbox relay (JOBFENCE's outbox_url is ``DATABASE_URL``; grace 1 s).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import sqlalchemy as sa
from celery import Celery

from jobfence.config import Settings
from jobfence.tasks import SqlEffects, current_job, make_engine, runtime_for, singleton_task
from jobfence.worker.setup import setup
from tests.integration.apps.common import app_on_first_access, make_app

FULFIL = "outbox.fulfil"
NAIVE_FULFIL = "naive.fulfil"
GRACE = 1.0

metadata = sa.MetaData()
#: What the web processes commit: one row per order (the ground truth of "committed").
orders = sa.Table(
    "storm_orders",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("mode", sa.String(16), nullable=False),
)
#: One row per run of a body (no unique key: a second run shows as a second row).
fulfilments = sa.Table(
    "storm_fulfilments",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.String(64), nullable=False),
    sa.Column("mode", sa.String(16), nullable=False),
)

_engine: sa.Engine | None = None


def settings_from(env: Mapping[str, str]) -> Settings:
    return Settings(
        lock_url=env["LOCK_URL"],
        database_url=env["DATABASE_URL"],
        outbox_url=env["DATABASE_URL"],
        outbox_grace=GRACE,
        outbox_poll=0.2,
        default_ttl=5.0,
        key_prefix="storm",
        key_secret="outbox-storm-secret-not-for-production",
    )


def engine(app: Celery) -> sa.Engine:
    """This process's engine on the storm's database (a forked child gets a fresh pool)."""
    global _engine
    if _engine is None:
        url = runtime_for(app).settings.database_url
        assert url
        _engine = make_engine(url)
    return _engine


def create_schema(url: str) -> None:
    eng = make_engine(url)
    try:
        SqlEffects(eng).create_schema()  # the fences, the DONE rows and the outbox
        metadata.create_all(eng)
    finally:
        eng.dispose()


def create_app(env: Mapping[str, str]) -> Celery:
    app = make_app("outbox_app", env)
    setup(app, settings_from(env))

    @singleton_task(app=app, name=FULFIL, key=["order_id"])
    def fulfil(order_id: str) -> str:
        with SqlEffects(engine(app)).transaction(current_job(), f"order:{order_id}") as tx:
            if not tx.done:
                tx.conn.execute(fulfilments.insert().values(order_id=order_id, mode="outbox"))
                tx.result = order_id
        return str(tx.result)

    @app.task(name=NAIVE_FULFIL, acks_late=True, reject_on_worker_lost=True)
    def naive_fulfil(order_id: str) -> str:
        with engine(app).begin() as conn:
            conn.execute(fulfilments.insert().values(order_id=order_id, mode="naive"))
        return order_id

    return app


__getattr__ = app_on_first_access(__name__, create_app)
_ = os  # the module reads os.environ through app_on_first_access
