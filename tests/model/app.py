"""The model test's Celery app: one ``@singleton_task`` per valid option combination, on one worker.

Every combination of ``on_conflict`` x ``lock_until`` x ``unique_for`` x ``dedupe_on_publish`` x
``on_duplicate_publish`` x ``concurrency`` x ``global_rate_limit`` that the decorator accepts is
registered once (:func:`valid_options`), so one in-process worker serves every example and an
example draws its combination by picking a task name. Each body records:

* its effect as a row of ``model_effects``, written through ``SqlEffects`` (fenced, committed
  with the job's DONE row), so a count of rows is a count of effects;
* its enter/exit times per concurrency group in a Redis list on the broker's server (never on
  the lock server, whose data the model flushes), so slot overlaps can be counted;
* what a chain's next step received, in the same Redis.

After a ``rotate`` step (:meth:`ModelApp.rotate`) the worker gates each delivery under one of
two key-secret configurations, alternately: its own runtime (secret A, B kept as previous)
and a second runtime on the same lock backend (B, A previous), the two-step roll-out's
side-by-side phase within one worker, so copies of one job meet under different secrets.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis
import sqlalchemy as sa
from celery import Celery, Task
from pydantic import SecretStr

from jobfence.config import Settings
from jobfence.locks import LockBackend
from jobfence.tasks import (
    Runtime,
    SingletonTask,
    current_job,
    install,
    make_engine,
    runtime_for,
    singleton_task,
)
from tests.integration.apps.common import celery_config
from tests.tasks.test_key_rotation import SlowRecordReads

__all__ = [
    "BODY_RETRY_COUNTDOWN",
    "LEASE_TTL",
    "MAX_RETRIES",
    "PLAIN",
    "REDELIVERY_LIMIT",
    "ModelApp",
    "Options",
    "build_app",
    "effects_table",
    "valid_options",
]

LEASE_TTL = 1.5
MAX_RETRIES = 3
BODY_RETRY_COUNTDOWN = 0.2
#: The longest countdown a rule publishes with (declared to jobfence as ``max_countdown``).
MAX_COUNTDOWN = 1.5
VISIBILITY_TIMEOUT = 10.0
WAIT_TIMEOUT = 2.0
#: Deliveries again (a commit outcome unknown, a lost lease) before a job is given up.
REDELIVERY_LIMIT = 5
RATE = "10/s"
#: A debounced task's quiet period and bound (seconds): short, as the model's bodies are.
DEBOUNCE = 0.3
DEBOUNCE_MAX_WAIT = 1.0
#: The secret a rotation rolls out beside the worker's own (a test value, never shown).
ROTATED_SECRET = "model-rotated-secret-Bb2-0123456789abcdef"

metadata = sa.MetaData()
#: One row per effect, committed in the job's fenced transaction with its DONE row.
effects_table = sa.Table(
    "model_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(255), nullable=False, index=True),
    sa.Column("task_id", sa.String(255), nullable=False),
    sa.Column("job_key", sa.String(255), nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
)


class BodyFailed(Exception):
    """Raised by a body drawn to fail (mode ``fail``): a FAILURE its caller must see."""


@dataclass(frozen=True)
class Options:
    """One combination of the options under test (the decorator's own names)."""

    on_conflict: str
    lock_until: str
    unique_for: float | None
    dedupe_on_publish: bool
    on_duplicate_publish: str
    concurrency: int
    global_rate_limit: str | None
    #: Issue 34: seconds of quiet before a burst runs, and its bound (None: no debounce).
    debounce: float | None = None
    debounce_max_wait: float | None = None

    @property
    def task_name(self) -> str:
        parts = (
            self.on_conflict,
            self.lock_until,
            f"u{self.unique_for or 0:g}",
            "d" if self.dedupe_on_publish else "nd",
            self.on_duplicate_publish,
            f"c{self.concurrency}",
            "r" if self.global_rate_limit else "nr",
        )
        if self.debounce is not None:
            parts += (f"db{self.debounce:g}", f"mw{self.debounce_max_wait or 0:g}")
        return "model.job." + ".".join(parts)

    @property
    def run_per_publish(self) -> bool:
        """Each publish is a run of its own (README "Lock lifetimes"), not one run per key."""
        return self.lock_until == "start" or self.unique_for is not None

    def decorator_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "on_conflict": self.on_conflict,
            "lock_until": self.lock_until,
            "unique_for": self.unique_for,
            "dedupe_on_publish": self.dedupe_on_publish,
            "on_duplicate_publish": self.on_duplicate_publish,
            "concurrency": self.concurrency,
            "global_rate_limit": self.global_rate_limit,
        }
        if self.debounce is not None:
            options["debounce"] = self.debounce
            options["debounce_max_wait"] = self.debounce_max_wait
        if self.concurrency:
            options["concurrency_key"] = ["group"]
        if self.global_rate_limit:
            options["rate_key"] = ["group"]
        return options


#: The control's "options": a plain ``@app.task`` with the same body, no jobfence.
PLAIN = Options("plain", "finish", None, False, "result", 0, None)


def valid_options() -> list[Options]:
    """Every combination the decorator accepts (README: the refusals at decoration)."""
    found = []
    for conflict, until, unique, dedupe, dup, conc, rate in itertools.product(
        ("skip", "wait", "retry", "raise"),
        ("finish", "start"),
        (None, 1.0),
        (False, True),
        ("result", "raise", "replace"),
        (0, 1, 2),
        (None, RATE),
    ):
        if until == "start" and (conflict == "skip" or unique is not None):
            continue
        if dup != "result" and not dedupe:
            continue
        found.append(Options(conflict, until, unique, dedupe, dup, conc, rate))
    # Debounce (issue 34) sets the claim, "replace" and lock_until="start" itself: the
    # combinations of what it leaves free (a wait or a retry behind a run, a slot, a rate).
    for conflict, conc, rate, max_wait in itertools.product(
        ("wait", "retry"), (0, 1), (None, RATE), (None, DEBOUNCE_MAX_WAIT)
    ):
        found.append(Options(conflict, "start", None, True, "replace", conc, rate,
                             DEBOUNCE, max_wait))  # fmt: skip
    # on_conflict="supersede" (issue 34) sets the claim, "replace" and lock_until="start"
    # itself too: what it leaves free is a slot and a rate.
    for conc, rate in itertools.product((0, 1), (None, RATE)):
        found.append(Options("supersede", "start", None, True, "replace", conc, rate))
    return found


class ModelApp:
    """The app, its tasks by option combination, and the clients the checks read with."""

    def __init__(self, app: Celery, ledger: redis.Redis, engine: sa.Engine) -> None:
        self.app = app
        self.ledger = ledger
        self.engine = engine
        self.tasks: dict[Options, Task] = {}
        #: The runtime under the rotated secret (built on the first rotation), and whether
        #: deliveries alternate between it and the worker's own.
        self.rotated: Runtime | None = None
        self.rotating = False
        self._turns: Iterator[int] = itertools.count()
        self._web: sa.Engine | None = None

    def web_engine(self) -> sa.Engine:
        """An engine of its own on the effects database, as a web process has: ``on_commit``
        steps commit through it, out of the ``cut_db`` cutter's sight (it cuts the worker's
        effect transactions, not the caller's own commit)."""
        if self._web is None:
            url = self.engine.url.render_as_string(hide_password=False)
            self._web = make_engine(url)
        return self._web

    def runtime_of(self, request: Any) -> Runtime:
        """The runtime that gates this delivery, chosen once per delivery (kept on its
        request): the worker's own, or during a rotation its own and the rotated one in turn."""
        own = runtime_for(self.app)
        if request.called_directly:  # a publish from the caller's thread: the caller's secret
            return own
        chosen: Runtime | None = getattr(request, "model_runtime", None)
        if chosen is None:
            turn = next(self._turns) if self.rotating else 0
            chosen = self.rotated if turn % 2 and self.rotated is not None else own
            request.model_runtime = chosen
        return chosen

    def reconfigure(self, read_delay: float) -> None:
        """Step 1 of the roll-out: the worker's runtime keeps the rotated secret as its
        previous one; the second runtime (rotated secret, the worker's as previous) shares its
        lock backend (so its locks, records and decision log). ``read_delay``: each record
        read of either answers that late (a slow link)."""
        own = runtime_for(self.app)
        if self.rotated is None:
            settings = own.settings.model_copy(update={
                "key_secret": SecretStr(ROTATED_SECRET),
                "key_secret_previous": (own.settings.key_secret,),
            })  # fmt: skip
            self.rotated = Runtime(settings, backend=own.backend)
        own.previous_secrets = (ROTATED_SECRET.encode(),)
        self._turns = itertools.count()  # the first delivery after it: the worker's own
        for rt in (own, self.rotated):
            rt.executor.backend = (
                cast("LockBackend", SlowRecordReads(rt.backend, read_delay))
                if read_delay
                else rt.backend
            )

    def unrotate(self) -> None:
        """Back to the worker's own secret alone (a sequence's start)."""
        self.rotating = False
        own = runtime_for(self.app)
        own.previous_secrets = own.settings.previous_secret_bytes()
        own.executor.backend = own.backend

    def runtimes(self) -> list[Runtime]:
        own = runtime_for(self.app)
        return [own] if self.rotated is None else [own, self.rotated]

    def close(self) -> None:
        """Stop the rotated runtime's threads (its backend is the worker's, closed with it)."""
        if self._web is not None:
            self._web.dispose()
        if self.rotated is not None:
            if self.rotated.executor.recorder is not None:
                self.rotated.executor.recorder.close()
            self.rotated.keeper.stop()

    def slot_events(self, group: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.ledger.lrange(f"model:slots:{group}", 0, -1)]

    def lapsed_holders(self, group: str) -> list[str]:
        """The task ids of deliveries whose slot (or lease) the keeper found gone mid-body."""
        return [json.loads(x)["task_id"] for x in self.ledger.lrange(f"model:lapsed:{group}",
                                                                    0, -1)]  # fmt: skip

    def tail_values(self, prefix: str) -> list[Any]:
        return [json.loads(x) for x in self.ledger.lrange(f"model:tails:{prefix}", 0, -1)]

    def effects(self, prefix: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(effects_table).where(effects_table.c.job_id.like(f"{prefix}%"))
            ).mappings()
            return [dict(row) for row in rows]


def _body(model: ModelApp) -> Any:
    def job(self: Task, job_id: str, group: str, mode: str, hold: float) -> dict[str, Any]:
        """The job: maybe retry or fail, hold its slot for ``hold`` s, then the fenced effect
        (mode ``checked``: after checking its lease, as a cooperative body does)."""
        if mode == "retry" and self.request.retries == 0:
            raise self.retry(countdown=BODY_RETRY_COUNTDOWN, exc=BodyFailed("asked a retry"))
        if mode == "fail":
            raise BodyFailed(f"{job_id} fails by design")
        if self.name == PLAIN.task_name:
            return _plain_effect(model, self.request.id, job_id, group, hold)
        ctx = current_job()
        slots = f"model:slots:{group}"
        task_id = self.request.id
        held = ctx.slot or ctx.lease

        def lapsed(_lease: Any, _cause: BaseException) -> None:
            # The keeper found the slot (or lease) gone mid-body: told at once, off the lock
            # server, so a body killed before it noticed still counts as lapsed.
            model.ledger.rpush(f"model:lapsed:{group}", json.dumps({"task_id": task_id}))

        held.on_lost(lapsed)
        enter = {"kind": "enter", "task_id": self.request.id, "t": time.monotonic()}
        model.ledger.rpush(slots, json.dumps(enter))
        try:
            time.sleep(hold)
            if mode == "checked":  # a cooperative body: stops on a lease lost while it held
                ctx.check()
            with runtime_for(self.app).effects.transaction(ctx, ctx.lease.key) as tx:
                if not tx.done:
                    tx.conn.execute(
                        effects_table.insert().values(
                            job_id=job_id, task_id=self.request.id, job_key=ctx.key,
                            fence=ctx.fence,
                        )
                    )  # fmt: skip
                    tx.result = {"job": job_id, "key": ctx.key}
            result: dict[str, Any] = tx.result
            return result
        finally:
            leave = {"kind": "exit", "task_id": self.request.id, "t": time.monotonic()}
            model.ledger.rpush(slots, json.dumps(leave))

    return job


def _plain_effect(
    model: ModelApp, task_id: str, job_id: str, group: str, hold: float
) -> dict[str, Any]:
    """The control's body: the same records, the effect written with no lock and no fence."""
    slots = f"model:slots:{group}"
    model.ledger.rpush(
        slots, json.dumps({"kind": "enter", "task_id": task_id, "t": time.monotonic()})
    )
    time.sleep(hold)
    key = f"plain:{job_id}"
    with model.engine.begin() as conn:
        conn.execute(
            effects_table.insert().values(job_id=job_id, task_id=task_id, job_key=key, fence=0)
        )
    model.ledger.rpush(
        slots, json.dumps({"kind": "exit", "task_id": task_id, "t": time.monotonic()})
    )
    return {"job": job_id, "key": key}


def build_app(env: Mapping[str, str], *, lock_url: str, database_url: str) -> ModelApp:
    """The app on ``env``'s broker (``BROKER_URL``, ``RESULT_BACKEND``, ``LEDGER_URL``)."""
    app = Celery("model", set_as_current=False)
    app.conf.update(celery_config({**env, "VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT)}))
    install(
        app,
        Settings(
            lock_url=lock_url,
            database_url=database_url,
            default_ttl=LEASE_TTL,
            socket_timeout=0.3,
            visibility_timeout=VISIBILITY_TIMEOUT,
            max_countdown=MAX_COUNTDOWN,
            redelivery_delay=0.2,
            redelivery_limit=REDELIVERY_LIMIT,
        ),
    )
    engine = runtime_for(app).effects.engine
    runtime_for(app).effects.create_schema()
    metadata.create_all(engine)
    model = ModelApp(app, redis.Redis.from_url(env["LEDGER_URL"], socket_timeout=5.0), engine)
    body = _body(model)

    class ModelTask(SingletonTask):
        """Gated by the runtime the model chose for the delivery (a rotation's two secrets)."""

        def _runtime(self) -> Runtime:
            return model.runtime_of(self.request)

    for options in valid_options():
        model.tasks[options] = singleton_task(
            app=app, name=options.task_name, bind=True, shared=False, max_retries=MAX_RETRIES,
            wait_timeout=WAIT_TIMEOUT, base=ModelTask, **options.decorator_options(),
        )(body)  # fmt: skip

    # The control: the same body as a plain Celery task (its options are never drawn).
    model.tasks[PLAIN] = app.task(name=PLAIN.task_name, bind=True, shared=False)(body)

    def tail(value: Any, prefix: str) -> Any:
        """A chain's next step: records what it received (a marker here is a violation)."""
        model.ledger.rpush(f"model:tails:{prefix}", json.dumps(value))
        return value

    app.task(name="model.tail", shared=False)(tail)
    return model
