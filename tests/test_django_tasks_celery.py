"""CeleryBackend's carrier: it follows the app's (signed) serializer, imports only known tasks."""

from __future__ import annotations

import json
import sys
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "jobfence.tasks.django_tasks", reason="needs django.tasks (Django 6) or the backport"
)

import redis
from celery import Celery
from django.conf import settings as django_settings
from django.test.utils import override_settings
from django.utils.functional import empty

from jobfence.tasks import TaskDefinitionError
from jobfence.tasks.django_tasks import CARRIER, carried_task
from jobfence.worker.checks import DJANGO_CARRIER, check_signed_carrier
from tests.djtasks import task
from tests.test_security import _self_signed

#: The Celery app CeleryBackend's OPTIONS name (set by each test).
APP: Any = None
BACKEND = "jobfence.tasks.django_tasks.CeleryBackend"


def charge(invoice_id: int) -> int:
    return invoice_id


@pytest.fixture(scope="module", autouse=True)
def django_configured() -> Iterator[None]:
    mine = not django_settings.configured
    if mine:
        django_settings.configure(USE_TZ=True)
    yield
    if mine:
        django_settings._wrapped = empty


def _enqueue_one(app: Celery, broker: redis.Redis) -> dict[str, Any]:
    """Enqueue `charge` through CeleryBackend on `app`; the raw message the broker holds."""
    global APP
    APP = app
    queue = f"djq-{uuid.uuid4().hex[:12]}"
    tasks = {"celery": {"BACKEND": BACKEND, "QUEUES": [queue],
                        "OPTIONS": {"app": f"{__name__}.APP"}}}  # fmt: skip
    with override_settings(TASKS=tasks):
        task(backend="celery", queue_name=queue)(charge).enqueue(7)
    raw = broker.lpop(queue)
    assert isinstance(raw, bytes)
    message: dict[str, Any] = json.loads(raw)
    return message


def test_a_signing_app_sends_django_tasks_signed(redis_url: str, tmp_path: Path) -> None:
    from celery.security.serialization import register_auth

    certfile, keyfile = _self_signed(tmp_path)
    # The `auth` serializer alone (app.setup_security() would also turn JSON off process-wide).
    register_auth(Path(keyfile).read_text(), None, Path(certfile).read_text(), certfile)
    broker = redis.Redis.from_url(redis_url)
    signed = Celery("signed-web", broker=redis_url, set_as_current=False)
    signed.conf.update(task_serializer="auth", accept_content=["auth"])
    plain = Celery("plain-web", broker=redis_url, set_as_current=False)
    try:
        # Main sent JSON whatever the app: a worker accepting only `auth` dropped the job.
        assert _enqueue_one(signed, broker)["content-type"] == "application/data"
        assert _enqueue_one(plain, broker)["content-type"] == "application/json"  # control
    finally:
        signed.close()
        plain.close()
        broker.close()


def test_the_carrier_follows_the_apps_serializer_json_or_auth() -> None:
    for serializer, expected in [("auth", "auth"), ("json", "json"), ("pickle", "json")]:
        app = Celery("carrier-app", set_as_current=False)
        app.conf.task_serializer = serializer
        assert app.tasks[CARRIER].serializer == expected, serializer
        app.close()


def test_the_carrier_refuses_a_path_it_does_not_know_before_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"jf_side_effect_{uuid.uuid4().hex[:12]}"
    mark = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    app = Celery("carrier-refuses", set_as_current=False)
    app.conf.task_always_eager = True
    try:
        out = app.tasks[CARRIER].apply(args=[f"{name}.anything", [], {}])
        assert out.failed() and isinstance(out.result, TaskDefinitionError)
        assert "not imported" in str(out.result)
        assert name not in sys.modules and not mark.exists()  # main imported it, then refused
        with pytest.raises(TaskDefinitionError, match="no Django task"):
            carried_task(12)  # type: ignore[arg-type]
    finally:
        app.close()
    __import__(name)  # the control: importing the path runs the module's code
    assert mark.exists()
    sys.modules.pop(name, None)


def carried(invoice_id: int) -> int:
    return invoice_id


def test_a_task_defined_on_a_celery_backend_is_carried(monkeypatch: pytest.MonkeyPatch) -> None:
    global APP
    APP = Celery("defines", set_as_current=False)
    tasks = {"celery": {"BACKEND": BACKEND, "OPTIONS": {"app": f"{__name__}.APP"}}}
    with override_settings(TASKS=tasks):
        defined = task(backend="celery")(carried)
        monkeypatch.setattr(sys.modules[__name__], "carried", defined)  # as @task leaves it
        assert carried_task(defined.module_path) is defined
        out = APP.tasks[CARRIER].apply(args=[defined.module_path, [5], {}])
        assert out.successful() and out.result == 5
    APP.close()


def test_a_signing_worker_that_carries_django_tasks_is_warned() -> None:
    assert DJANGO_CARRIER == CARRIER
    carrier = [types.SimpleNamespace(name=CARRIER)]

    def conf(serializer: str, *accepted: str) -> Any:
        return types.SimpleNamespace(task_serializer=serializer, accept_content=list(accepted))

    only_signed = list(check_signed_carrier(conf("auth", "auth"), carrier))
    assert len(only_signed) == 1 and not only_signed[0].refuse
    assert "setup_security()" in only_signed[0].fix
    also_json = list(check_signed_carrier(conf("auth", "auth", "json"), carrier))
    assert len(also_json) == 1 and "signing is off" in also_json[0].problem
    assert list(check_signed_carrier(conf("json", "json"), carrier)) == []
    assert list(check_signed_carrier(conf("auth", "auth"), [])) == []
