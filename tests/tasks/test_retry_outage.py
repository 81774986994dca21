"""A body's `self.retry()` while the lock server does not answer: the retry goes out and the
job runs again after the lease's TTL; the unanswered release never fails the job (found by
the model's long run, issue 29: a blip during a retry failed it with BackendUnavailable)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from jobfence.config import Settings
from jobfence.tasks import install, runtime_for, singleton_task
from tests.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration]

TTL = 2.0


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    """The broker and results on one private server, the locks on another (paused here)."""
    with RedisServer() as broker, RedisServer() as locks:
        yield broker, locks


def test_a_retry_while_the_lock_server_is_paused_runs_again_after_the_ttl(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    broker, locks = servers
    app = Celery(f"retry-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(broker_url=broker.db_url(1), result_backend=broker.db_url(2),
                    task_serializer="json", result_serializer="json", accept_content=["json"],
                    task_acks_late=True)  # fmt: skip
    install(app, Settings(lock_url=locks.url, key_secret="k" * 40, default_ttl=TTL,
                          socket_timeout=0.3))  # fmt: skip
    entered, paused = threading.Event(), threading.Event()
    attempts: list[int] = []

    @singleton_task(app=app, name="outage.charge", key=["job"], shared=False, bind=True,
                    ttl=TTL, max_retries=3)  # fmt: skip
    def charge(self, job: str) -> str:  # type: ignore[no-untyped-def]
        attempts.append(self.request.retries)
        if self.request.retries == 0:
            entered.set()
            assert paused.wait(10)
            raise self.retry(countdown=0.1)  # its release meets the paused server
        return "charged"

    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                          loglevel="WARNING", shutdown_timeout=10.0):  # fmt: skip
            result = charge.delay("j-1")
            assert entered.wait(10)
            with locks.suspended():
                paused.set()
                # RETRY once the retry went out; FAILURE where the release failed the job.
                wait_for(lambda: result.state in ("RETRY", "FAILURE"), 10.0, interval=0.02)
            assert result.get(timeout=3 * TTL + 10) == "charged"
        assert attempts == [0, 1]
    finally:
        runtime_for(app).close()
        app.close()
