"""Rotating JOBFENCE_KEY_SECRET: old secrets still find finished and running jobs (real Redis)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from jobfence.config import Settings
from jobfence.locks import Lease
from jobfence.locks.backend import default_meta
from jobfence.tasks import DuplicateSkipped, Runtime, runtime_for, singleton_task
from jobfence.tasks.keys import secret_id
from jobfence.worker.checks import EX_CONFIG, StartupRefused, check_key_secret, enforce
from tests.servers import RedisServer
from tests.tasks.conftest import AppFactory, unique

OLD, NEW = "old-secret-Aa1-0123456789abcdefghij", "new-secret-Bb2-0123456789abcdefghij"
REPO_ROOT = Path(__file__).resolve().parents[2]


def charge_on(app: Celery, name: str, charges: list[int], **options: Any) -> Any:
    """A payment-like task named `name` on `app`: each run of its body is one charge."""

    def charge(payment_id: int) -> dict[str, int]:
        charges.append(payment_id)
        return {"charged": payment_id}

    return singleton_task(app=app, shared=False, name=name, **options)(charge)


def test_a_job_done_under_the_old_secret_replays_after_rotation(make_app: AppFactory) -> None:
    charges: list[int] = []
    name = unique("tests.charge")
    before = charge_on(make_app(key_secret=OLD), name, charges)
    assert before.delay(7).get() == {"charged": 7}
    after = charge_on(make_app(key_secret=NEW, key_secret_previous=OLD), name, charges)
    assert after.delay(7).get() == {"charged": 7}  # the stored result, no second charge
    assert charges == [7]
    assert after.delay(8).get() == {"charged": 8}  # a new job runs, granted under NEW
    assert charges == [7, 8]


def test_control_a_plain_rotation_charges_again(make_app: AppFactory) -> None:
    charges: list[int] = []
    name = unique("tests.charge")
    charge_on(make_app(key_secret=OLD), name, charges).delay(7).get()
    charge_on(make_app(key_secret=NEW), name, charges).delay(7).get()
    assert charges == [7, 7]


def test_a_job_held_under_the_old_secret_is_a_conflict(make_app: AppFactory) -> None:
    charges: list[int] = []
    name = unique("tests.charge")
    old_app = make_app(key_secret=OLD)
    old_task = charge_on(old_app, name, charges)
    key, fingerprint = old_task.identity((7,), {})
    held = runtime_for(old_app).backend.begin(
        key, 30, meta=default_meta(task_id="elsewhere"), record=True, fingerprint=fingerprint
    )
    assert isinstance(held, Lease)
    new_app = make_app(key_secret=NEW, key_secret_previous=f"unused-secret,{OLD}")
    new_task = charge_on(new_app, name, charges, on_conflict="skip")
    with pytest.raises(DuplicateSkipped) as stop:
        new_task.delay(7).get()
    assert stop.value.task_id == "elsewhere"  # the old-secret holder's task answers
    assert charges == []
    new_key, _ = new_task.identity((7,), {})
    assert runtime_for(new_app).backend.inspect(new_key) is None  # our grant was given back
    held.release()
    assert new_task.delay(7).get() == {"charged": 7}


@pytest.fixture
def runtimes(redis_url: str) -> Iterator[Callable[..., Runtime]]:
    """Runtimes on the private Redis under one key prefix of their own (no reset from env)."""
    prefix = unique("rotation")
    made: list[Runtime] = []

    def build(secret: str, **settings: Any) -> Runtime:
        settings.setdefault("key_secret_reset", False)
        rt = Runtime(Settings(lock_url=redis_url, key_prefix=prefix, key_secret=secret, **settings))
        made.append(rt)
        return rt

    yield build
    for rt in made:
        rt.close()


def test_a_new_secret_without_its_predecessor_is_refused_at_start(
    runtimes: Callable[..., Runtime],
) -> None:
    assert list(check_key_secret(runtimes(OLD))) == []  # the first start keeps its id
    assert list(check_key_secret(runtimes(OLD))) == []
    [refused] = check_key_secret(runtimes(NEW))
    assert refused.refuse and refused.setting == "JOBFENCE_KEY_SECRET"
    assert "JOBFENCE_KEY_SECRET_PREVIOUS" in refused.fix and "RESET" in refused.fix
    assert secret_id(OLD.encode()) in refused.problem
    assert OLD not in str(refused) and NEW not in str(refused)


def test_a_rotation_with_the_old_secret_as_previous_is_accepted(
    runtimes: Callable[..., Runtime],
) -> None:
    assert list(check_key_secret(runtimes(OLD))) == []
    assert list(check_key_secret(runtimes(NEW, key_secret_previous=[OLD]))) == []
    # Once rolled out, the old secret can go: the lock server now keeps the new one's id.
    assert list(check_key_secret(runtimes(NEW))) == []
    assert list(check_key_secret(runtimes(OLD))) != []


def test_an_explicit_reset_starts_afresh(runtimes: Callable[..., Runtime]) -> None:
    assert list(check_key_secret(runtimes(OLD))) == []
    assert list(check_key_secret(runtimes(NEW, key_secret_reset=True))) == []
    assert list(check_key_secret(runtimes(NEW))) == []


def test_the_worker_start_up_refuses_the_unknown_secret(
    runtimes: Callable[..., Runtime],
) -> None:
    app = Celery(unique("rotation-app"), set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], task_acks_late=True,
                    task_reject_on_worker_lost=True, broker_url="memory://localhost/")  # fmt: skip
    try:
        enforce(app, runtimes(OLD))
        with pytest.raises(StartupRefused, match="JOBFENCE_KEY_SECRET: is not the key secret"):
            enforce(app, runtimes(NEW))
    finally:
        app.close()


def test_a_real_worker_with_an_unknown_secret_exits_with_how_to_rotate(
    fresh_redis: RedisServer,
) -> None:
    seeded = Runtime(Settings(lock_url=fresh_redis.url, key_secret=OLD, key_secret_reset=False))
    try:
        assert list(check_key_secret(seeded)) == []  # a fleet ran under OLD
    finally:
        seeded.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBFENCE_")}
    env.update(JOBFENCE_LOCK_URL=fresh_redis.url, JOBFENCE_KEY_SECRET=NEW)
    args = [sys.executable, "-m", "celery", "-A", "jobfence.worker.celery_app", "worker",
            "--pool", "solo"]  # fmt: skip
    done = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == EX_CONFIG, output
    assert "refusing to start the worker" in output and "JOBFENCE_KEY_SECRET_PREVIOUS" in output
    assert OLD not in output and NEW not in output


def test_previous_secrets_are_read_from_the_environment_and_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JOBFENCE_KEY_SECRET", NEW)
    monkeypatch.setenv("JOBFENCE_KEY_SECRET_PREVIOUS", f"{OLD}, older-secret-Cc3")
    settings = Settings()
    assert settings.previous_secret_bytes() == (OLD.encode(), b"older-secret-Cc3")
    assert OLD not in repr(settings) and OLD not in str(settings)
