"""The model app for ``celery -A tests.model.worker_main worker``: the second worker's process."""

from __future__ import annotations

from collections.abc import Mapping

from celery import Celery

from jobfence.worker import custody
from tests.integration.apps.common import app_on_first_access
from tests.model.app import build_app


def put_back_under_the_same_tag() -> None:
    """The control's custody (``NAIVE_PUT_BACK`` set): a message put back under the tag its
    paused holder still holds (kombu's ``restore_by_tag``), as before issue 29's defect 1."""
    from jobfence.worker.custody import Custody

    def put_back(self: Custody, tag: str) -> bool:
        self.qos.restore_by_tag(tag, client=self.channel.client)
        return True

    Custody.put_back = put_back  # type: ignore[method-assign]


def create_app(env: Mapping[str, str]) -> Celery:
    """The harness's app (same tasks, broker, locks and effects database), custody on."""
    model = build_app(env, lock_url=env["LOCK_URL"], database_url=env["DATABASE_URL"])
    custody.connect(model.app)
    if env.get("NAIVE_PUT_BACK"):
        put_back_under_the_same_tag()
    return model.app


__getattr__ = app_on_first_access(__name__, create_app)
