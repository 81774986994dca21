"""@singleton_task without a worker: eager apps, direct calls, and publishing to a Redis broker."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import MaxRetriesExceededError
from kombu.exceptions import OperationalError

from jobfence.config import JobfenceError
from jobfence.locks import AcquireTimeout, Lease, LockError, RedisBackend
from jobfence.locks.backend import default_meta
from jobfence.tasks import (
    DUPLICATE,
    HEADER,
    ArgumentsNotSerializable,
    BadArguments,
    DuplicateJob,
    DuplicateSkipped,
    IdempotencyConflict,
    SingletonTask,
    TaskDefinitionError,
    current_lease,
    runtime_for,
    singleton_task,
)
from tests.servers import free_port
from tests.tasks.conftest import AppFactory, unique


def define(app: Celery, body: Any, **options: Any) -> Any:
    """Register `body` as a singleton task with a name no other test uses."""
    options.setdefault("name", unique("tests.task"))
    return singleton_task(app=app, shared=False, **options)(body)


def occupy(app: Celery, task: Any, args: tuple[Any, ...], task_id: str = "elsewhere") -> Lease:
    """Hold `task(*args)`'s lease as another worker would."""
    key, fp = task.identity(args, {})
    got = runtime_for(app).backend.begin(
        key, 30, meta=default_meta(task_id=task_id), record=True, fingerprint=fp
    )
    assert isinstance(got, Lease)
    return got


# -- the decorator -----------------------------------------------------------------------


def _f(x: int, y: int = 0) -> int:
    return x + y


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"on_conflict": "sometimes"}, "on_conflict"),
        ({"ttl": 0}, "ttl"),
        ({"ttl": -5}, "ttl"),
        ({"wait_timeout": -1}, "wait_timeout"),
        ({"result_ttl": 0}, "result_ttl"),
        ({"serializer": "pickle"}, "serializer"),
        ({"serializer": "yaml"}, "serializer"),
        ({"key": ["z"]}, "key"),
        ({"key": ("x", "nope")}, "nope"),
    ],
)
def test_decorator_validates_its_options(
    make_app: AppFactory, options: dict[str, Any], field: str
) -> None:
    app = make_app()
    with pytest.raises(ValueError, match=field):
        define(app, _f, **options)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("amont", "key names 'amont', which is not a parameter of charge(order_id, amount); "
         "did you mean 'amount'?"),
        (["order_id", "self"], "key names 'self'"),  # bind=True: the task is never a key
        ([], "key=[] names no argument"),
        (7, "key must be an argument name"),
        ([b"order_id"], "key must be an argument name"),
        (
            lambda order_id: order_id,
            "key callable '<lambda>' is called with the arguments of charge(order_id, amount) "
            "by name, and got an unexpected keyword argument 'amount'",
        ),
    ],
)
def test_a_key_that_cannot_work_is_refused_at_decoration(
    make_app: AppFactory, key: Any, message: str
) -> None:
    app = make_app()

    def charge(self: Any, order_id: str, amount: int) -> int:
        return amount

    with pytest.raises(TaskDefinitionError) as refused:
        define(app, charge, key=key, bind=True)
    assert str(refused.value).startswith(message)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, JobfenceError)


def test_a_key_callable_taking_every_argument_is_accepted(make_app: AppFactory) -> None:
    app = make_app()

    def charge(order_id: str, amount: int) -> int:
        return amount

    task = define(app, charge, key=lambda order_id, **_: order_id)
    assert task.identity(("o-1", 5), {})[0] == task.identity(("o-1", 9), {})[0]


def test_key_as_one_string_means_that_one_argument(make_app: AppFactory) -> None:
    app = make_app()
    runs: list[int] = []

    def charge(payment_id: str, amount: int) -> int:
        runs.append(amount)
        return amount

    task = define(app, charge, key="payment_id")
    assert task.jobfence_key == ("payment_id",)
    assert task.delay("p-1", 100).get() == 100
    # The same payment id with another amount is the same job, so this is a conflicting reuse.
    with pytest.raises(IdempotencyConflict):
        task.delay("p-1", 999).get()
    assert task.delay("p-2", 999).get() == 999
    assert runs == [100, 999]


def test_a_key_may_name_what_arrives_through_kwargs(make_app: AppFactory) -> None:
    app = make_app()

    def by_order(**kw: Any) -> Any:
        return kw["order"]

    task = define(app, by_order, key="order")
    assert task.delay(order="o-1", note="x").get() == "o-1"


@pytest.mark.parametrize("where", ["publish", "call"])
def test_an_unknown_keyword_argument_is_a_type_error_naming_it(
    make_app: AppFactory, where: str
) -> None:
    app = make_app(eager=False)
    name = unique("shop.charge")

    def charge(payment_id: str, amount: int) -> int:
        return amount

    task = define(app, charge, name=name)
    with pytest.raises(TypeError) as refused:
        if where == "publish":
            task.delay("p-1", amont=100)
        else:
            task("p-1", amont=100)
    assert str(refused.value) == f"{name}() got an unexpected keyword argument 'amont'"
    assert isinstance(refused.value, BadArguments)
    assert not isinstance(refused.value, ArgumentsNotSerializable)


def test_unknown_keyword_is_reported_before_the_runtime_is_looked_up(
    make_app: AppFactory,
) -> None:
    app = make_app(installed=False)
    task = define(app, _f)
    with pytest.raises(BadArguments, match="unexpected keyword argument 'z'"):
        task.delay(1, z=2)


def test_a_non_json_argument_at_publish_names_the_argument(make_app: AppFactory) -> None:
    app = make_app(eager=False)
    name = unique("shop.charge")

    def charge(payment_id: str, when: Any) -> None:
        return None

    task = define(app, charge, name=name)
    with pytest.raises(ArgumentsNotSerializable) as refused:
        task.delay("p-secret-77", datetime.datetime(2031, 1, 2))
    text = str(refused.value)
    assert text.startswith(f"argument 'when' of {name}: datetime is not JSON-serialisable")
    assert "pass an ISO string" in text
    assert "p-secret-77" not in text and "2031" not in text


def test_decorator_accepts_valid_options(make_app: AppFactory) -> None:
    app = make_app()
    task = define(
        app,
        _f,
        key=["x"],
        ttl=5,
        on_conflict="wait",
        wait_timeout=0,
        result_ttl=60,
        dedupe_on_publish=True,
    )
    assert isinstance(task, SingletonTask)
    assert (task.jobfence_key, task.jobfence_ttl, task.on_conflict) == (("x",), 5, "wait")
    assert (task.wait_timeout, task.result_ttl, task.dedupe_on_publish) == (0, 60, True)


def test_celery_options_pass_through_and_safe_defaults_hold(make_app: AppFactory) -> None:
    app = make_app()
    task = singleton_task(
        app=app, shared=False, name="tests.custom.name", max_retries=7, time_limit=99
    )(_f)
    assert task.name == "tests.custom.name"
    assert app.tasks["tests.custom.name"].max_retries == 7
    assert (task.max_retries, task.time_limit) == (7, 99)
    assert task.acks_late is True and task.reject_on_worker_lost is True
    assert task.serializer == "json"
    relaxed = singleton_task(app=app, shared=False, name=unique("t"), acks_late=False)(_f)
    assert relaxed.acks_late is False


def test_bare_decorator_form(make_app: AppFactory) -> None:
    app = make_app()

    @singleton_task(app=app, shared=False, name=unique("tests.bare"))
    def double(x: int) -> int:
        return 2 * x

    assert double.delay(4).get() == 8


# -- the body's view ---------------------------------------------------------------------


def test_bound_task_sees_its_lease(make_app: AppFactory) -> None:
    app = make_app()

    def body(self: Any, x: int) -> dict[str, Any]:
        lease = self.lease
        return {
            "same": lease is current_lease(),
            "held": lease.held,
            "fence": lease.fence,
            "key": self.job.key,
            "lease_key": lease.key,
            "task_id": self.job.task_id,
        }

    task = define(app, body, bind=True)
    result = task.apply_async((3,), task_id="tid-1")
    value = result.get()
    key, _ = task.identity((3,), {})
    assert value["same"] is True and value["held"] is True
    assert value["key"] == value["lease_key"] == key
    assert value["task_id"] == "tid-1"
    assert isinstance(value["fence"], int) and value["fence"] > 0
    with pytest.raises(LockError, match="no jobfence job is running"):
        task.lease  # noqa: B018 - outside a run there is no lease


# -- gating in eager mode and on direct calls ---------------------------------------------


def test_eager_duplicates_replay_the_stored_result(make_app: AppFactory) -> None:
    app = make_app()
    calls: list[int] = []

    def body(x: int) -> dict[str, int]:
        calls.append(x)
        return {"x": x, "n": len(calls)}

    task = define(app, body)
    assert task.delay(1).get() == {"x": 1, "n": 1}
    assert task.delay(x=1).get() == {"x": 1, "n": 1}  # replayed, not run
    assert task.delay(2).get() == {"x": 2, "n": 2}
    assert calls == [1, 2]


def test_direct_call_is_gated_too(make_app: AppFactory) -> None:
    app = make_app()
    calls: list[int] = []

    def body(x: int) -> int:
        calls.append(x)
        return x * 10

    task = define(app, body)
    assert task(5) == 50
    assert task(5) == 50
    assert task.delay(5).get() == 50
    assert calls == [5]


def test_a_failed_run_may_run_again(make_app: AppFactory) -> None:
    app = make_app()
    calls: list[int] = []

    def body(x: int) -> str:
        calls.append(x)
        if len(calls) == 1:
            raise RuntimeError("flaky")
        return "ok"

    task = define(app, body)
    with pytest.raises(RuntimeError, match="flaky"):
        task.delay(1).get()
    key, _ = task.identity((1,), {})
    record = runtime_for(app).backend.job_record(key)
    assert record is not None and record.state == "FAILED"
    assert task.delay(1).get() == "ok"
    assert calls == [1, 1]


CARD = "4111111111111111"


@pytest.mark.parametrize("keep", [False, True])
def test_a_failed_record_keeps_the_exception_type_not_its_message(
    make_app: AppFactory, keep: bool
) -> None:
    # The key's HMAC hides the arguments; a message quoting them must not undo it on the
    # lock server for JOBFENCE_RESULT_TTL. Control: the opt-in stores the message (main did
    # so always).
    app = make_app(failed_record_message=True) if keep else make_app()

    def body(card: str) -> None:
        raise ValueError(f"card {card} was declined")

    task = define(app, body)
    with pytest.raises(ValueError, match="was declined"):
        task.delay(CARD).get()
    key, _ = task.identity((CARD,), {})
    backend = runtime_for(app).backend
    record = backend.job_record(key)
    assert record is not None and record.state == "FAILED"
    assert isinstance(backend, RedisBackend)  # the raw bytes on the lock server, read back
    raw = backend.client.get(backend.keys.record(key))
    assert raw is not None
    if keep:
        assert json.loads(record.result) == {
            "error": "ValueError", "message": f"card {CARD} was declined"}  # fmt: skip
        assert CARD in raw
    else:
        assert json.loads(record.result) == {"error": "ValueError"}  # the type still says why
        assert CARD not in raw


def test_self_retry_does_not_wait_on_its_own_lock(make_app: AppFactory) -> None:
    app = make_app()
    app.conf.task_eager_propagates = False  # let apply() run the retry eagerly
    attempts: list[int] = []

    def body(self: Any, x: int) -> int:
        attempts.append(self.request.retries)
        if len(attempts) < 3:
            raise self.retry(countdown=0)
        return len(attempts)

    task = define(app, body, bind=True, max_retries=5)
    assert task.delay(1).get() == 3
    assert attempts == [0, 1, 2]
    key, _ = task.identity((1,), {})
    assert runtime_for(app).backend.inspect(key) is None


def test_busy_skip_stops_with_duplicate_skipped(make_app: AppFactory) -> None:
    app = make_app()
    calls: list[int] = []

    def body(x: int) -> None:
        calls.append(x)

    task = define(app, body, on_conflict="skip")
    occupy(app, task, (1,))
    with pytest.raises(DuplicateSkipped, match="on_conflict='skip'") as caught:
        task.delay(1)
    assert isinstance(caught.value, DuplicateJob) and caught.value.marker == DUPLICATE
    assert calls == []


def test_busy_raise_raises_duplicate_job(make_app: AppFactory) -> None:
    app = make_app()
    task = define(app, _f, on_conflict="raise")
    occupy(app, task, (1,))
    with pytest.raises(DuplicateJob):
        task.delay(1).get()


def test_busy_wait_times_out(make_app: AppFactory) -> None:
    app = make_app()
    task = define(app, _f, on_conflict="wait", wait_timeout=0.2)
    occupy(app, task, (1,))
    with pytest.raises(AcquireTimeout):
        task.delay(1).get()


def test_busy_retry_in_eager_mode_gives_up_after_max_retries(make_app: AppFactory) -> None:
    app = make_app()
    app.conf.task_eager_propagates = False  # let apply() run the retries eagerly
    calls: list[int] = []

    def body(x: int) -> None:
        calls.append(x)

    task = define(app, body, on_conflict="retry", max_retries=2)
    occupy(app, task, (1,))
    with pytest.raises(MaxRetriesExceededError):
        task.delay(1).get()
    assert calls == []


# -- explicit idempotency keys -----------------------------------------------------------


def test_explicit_idempotency_key_replays_and_detects_reuse(make_app: AppFactory) -> None:
    app = make_app()
    calls: list[int] = []

    def body(amount: int) -> dict[str, int]:
        calls.append(amount)
        return {"charged": amount}

    task = define(app, body)
    first = task.apply_async((10,), idempotency_key="order-42").get()
    again = task.apply_async((10,), idempotency_key="order-42").get()
    assert first == again == {"charged": 10}
    assert calls == [10]
    with pytest.raises(IdempotencyConflict):
        task.apply_async((99,), idempotency_key="order-42").get()
    assert task.apply_async((10,), idempotency_key="order-43").get() == {"charged": 10}
    assert task.delay(10).get() == {"charged": 10}  # the argument-derived key is another job
    assert calls == [10, 10, 10]


def test_key_selector_defines_the_job_identity(make_app: AppFactory) -> None:
    """key=["account"]: one job per account; other amounts for it are a reuse of the key."""
    app = make_app()
    calls: list[tuple[int, int]] = []

    def body(account: int, amount: int) -> int:
        calls.append((account, amount))
        return amount

    task = define(app, body, key=["account"])
    assert task.delay(1, 10).get() == 10
    assert task.delay(1, 10).get() == 10
    with pytest.raises(IdempotencyConflict):
        task.delay(1, 20).get()
    assert task.delay(2, 20).get() == 20
    assert calls == [(1, 10), (2, 20)]


@pytest.mark.parametrize("bad", ["", 42])
def test_bad_idempotency_key_is_refused(make_app: AppFactory, bad: Any) -> None:
    app = make_app()
    task = define(app, _f)
    with pytest.raises(ArgumentsNotSerializable, match="idempotency_key"):
        task.apply_async((1,), idempotency_key=bad)


# -- dedupe on publish (a real broker on the private Redis, no worker) --------------------


def test_dedupe_on_publish_returns_the_queued_task(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)
    calls: list[int] = []

    def body(x: int) -> int:
        calls.append(x)
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")
        return x

    task = define(app, body, dedupe_on_publish=True)
    first = task.delay(1)
    second = task.delay(1)
    assert second.id == first.id
    assert redis_client.llen("celery") == 1  # one message on the broker
    other = task.delay(2)
    assert other.id != first.id
    assert redis_client.llen("celery") == 2

    # Execute it here (as a worker would, under its task id) and fail: the queued marker is
    # cleared ... (owner-checked: a direct call, holding no claim, would leave it)
    with pytest.raises(RuntimeError):
        task.apply((1,), task_id=first.id, throw=True)
    third = task.delay(1)
    assert third.id != first.id
    assert redis_client.llen("celery") == 3
    # ... while a success keeps it: the finished job's id is still the answer.
    assert task(1) == 1
    assert task.delay(1).id == third.id
    assert redis_client.llen("celery") == 3


def test_a_failed_publish_does_not_leave_a_phantom_marker(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    """The broker refused the message: the next publish must try again, not return its id."""
    app = make_app(eager=False)
    app.conf.broker_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    app.conf.broker_transport_options = {"max_retries": 0}  # fail fast
    task = define(app, _f, dedupe_on_publish=True)
    with pytest.raises(OperationalError):
        task.apply_async((1,), retry=False)
    key, _ = task.identity((1,), {})
    assert redis_client.exists(f"jobfence:queued:{{{key}}}") == 0
    with pytest.raises(OperationalError):  # tried again, so it fails again
        task.apply_async((1,), retry=False)


def test_dedupe_on_publish_is_off_by_default(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)
    task = define(app, _f)
    assert task.delay(1).id != task.delay(1).id
    assert redis_client.llen("celery") == 2


def test_publish_carries_the_idempotency_key_header(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)
    task = define(app, _f)
    task.apply_async((1,), idempotency_key="invoice-9")
    message = json.loads(redis_client.lindex("celery", 0) or b"{}")
    assert message["headers"][HEADER] == "invoice-9"
