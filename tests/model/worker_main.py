"""The model app for ``celery -A tests.model.worker_main worker``: the second worker's process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from celery import Celery

from jobfence.locks.decisions import Decision
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


def report_stored_decisions() -> None:
    """Each batch the decision recorder stores is reported to the fleet's events (kind
    ``stored``), so a kill's lost decisions are told apart from a log that is untrue by
    what was stored, not by how long ago a delivery ended (a starved writer)."""
    from jobfence.tasks.decisions import DecisionRecorder
    from tests.integration import fleet_hooks

    original = DecisionRecorder._store

    def _store(self: DecisionRecorder, batch: list[Decision]) -> None:
        store = self.store
        if store is not None and "append_many" not in vars(store):
            inner = store.append_many

            def append_many(entries: Sequence[Decision]) -> None:
                inner(entries)  # raises as before: then nothing is reported
                fleet_hooks.stored_decisions({d.task_id for d in entries})

            store.append_many = append_many  # type: ignore[method-assign]
        original(self, batch)

    DecisionRecorder._store = _store  # type: ignore[method-assign]


def create_app(env: Mapping[str, str]) -> Celery:
    """The harness's app (same tasks, broker, locks and effects database), custody on."""
    model = build_app(env, lock_url=env["LOCK_URL"], database_url=env["DATABASE_URL"])
    custody.connect(model.app)
    report_stored_decisions()
    if env.get("NAIVE_PUT_BACK"):
        put_back_under_the_same_tag()
    return model.app


__getattr__ = app_on_first_access(__name__, create_app)
