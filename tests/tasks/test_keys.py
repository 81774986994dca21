"""Idempotency keys: bound arguments, selectors, explicit keys, secrets and canonical JSON."""

from __future__ import annotations

import datetime
import decimal
import enum
import inspect
import json
import math
import random
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from jobfence.config import JobfenceError
from jobfence.tasks import ArgumentsNotSerializable, BadArguments, singleton_task
from jobfence.tasks.keys import bind_arguments, canonical_json, fingerprint, identity, job_key
from tests.tasks.conftest import AppFactory, unique

SECRET = b"test-secret"


def charge(account: int, amount: int, currency: str = "EUR", note: str | None = None) -> None:
    """A plain function whose signature the keys are bound to."""


def key_of(fn: Any, *args: Any, selector: Any = None, **kwargs: Any) -> str:
    return job_key(SECRET, "tests.charge", bind_arguments(fn, args, kwargs), selector=selector)


# -- one job, one key ------------------------------------------------------------------


def test_positional_keyword_and_defaults_give_one_key() -> None:
    forms = {
        key_of(charge, 1, 100),
        key_of(charge, 1, amount=100),
        key_of(charge, account=1, amount=100),
        key_of(charge, amount=100, account=1),
        key_of(charge, 1, 100, "EUR"),
        key_of(charge, 1, 100, currency="EUR", note=None),
    }
    assert len(forms) == 1
    assert key_of(charge, 1, 100, "USD") not in forms
    assert key_of(charge, 2, 100) not in forms


def test_task_identity_binds_to_the_task_signature(make_app: AppFactory) -> None:
    app = make_app()

    @singleton_task(app=app, name=unique("tests.identity"), shared=False)
    def transfer(source: int, target: int, amount: int = 10) -> int:
        return amount

    a = transfer.identity((1, 2), {})
    b = transfer.identity((), {"target": 2, "source": 1, "amount": 10})
    c = transfer.identity([1], {"target": 2})
    assert a == b == c
    assert transfer.identity((1, 2, 11), {})[0] != a[0]


def test_the_task_name_is_part_of_the_key() -> None:
    args = bind_arguments(charge, (1, 100), {})
    assert job_key(SECRET, "a.task", args) != job_key(SECRET, "b.task", args)
    assert job_key(SECRET, "a.task", args).startswith("a.task:")


def test_key_list_selects_arguments() -> None:
    k1 = key_of(charge, 1, 100, note="first", selector=["account", "amount"])
    k2 = key_of(charge, 1, 100, note="second", selector=["account", "amount"])
    k3 = key_of(charge, 1, 200, note="first", selector=["account", "amount"])
    assert k1 == k2
    assert k1 != k3
    # The fingerprint still covers every argument, so reuse with other arguments is caught.
    f1 = fingerprint(SECRET, bind_arguments(charge, (1, 100), {"note": "first"}))
    f2 = fingerprint(SECRET, bind_arguments(charge, (1, 100), {"note": "second"}))
    assert f1 != f2


def test_key_list_naming_unknown_argument_is_refused() -> None:
    with pytest.raises(ArgumentsNotSerializable, match="unknown arguments"):
        key_of(charge, 1, 100, selector=["acount"])


def test_key_callable_selects_what_is_unique() -> None:
    def by_day(account: int, amount: int, currency: str, note: str | None) -> Any:
        return [account, currency]

    assert key_of(charge, 1, 100, selector=by_day) == key_of(charge, 1, 999, selector=by_day)
    assert key_of(charge, 1, 100, selector=by_day) != key_of(charge, 1, 100, "USD", selector=by_day)


def test_key_callable_result_must_be_json() -> None:
    with pytest.raises(ArgumentsNotSerializable):
        key_of(charge, 1, 100, selector=lambda **kw: {object()})


def test_explicit_key_overrides_the_arguments() -> None:
    a = bind_arguments(charge, (1, 100), {})
    b = bind_arguments(charge, (2, 500), {})
    assert job_key(SECRET, "t", a, explicit="order-7") == job_key(
        SECRET, "t", b, explicit="order-7"
    )
    assert job_key(SECRET, "t", a, explicit="order-7") != job_key(
        SECRET, "t", a, explicit="order-8"
    )
    assert job_key(SECRET, "t", a, explicit="order-7") != job_key(SECRET, "t", a)
    assert "order-7" not in job_key(SECRET, "t", a, explicit="order-7")


def test_different_secret_gives_different_key_and_fingerprint() -> None:
    args = bind_arguments(charge, (1, 100), {})
    assert job_key(b"one", "t", args) != job_key(b"two", "t", args)
    assert fingerprint(b"one", args) != fingerprint(b"two", args)


def test_different_key_secret_setting_gives_different_task_key(make_app: AppFactory) -> None:
    app1 = make_app(key_secret="first-secret-" + "1" * 32)
    app2 = make_app(key_secret="second-secret-" + "2" * 32)
    name = unique("tests.secret")

    def body(x: int) -> int:
        return x

    t1 = singleton_task(app=app1, name=name, shared=False)(body)
    t2 = singleton_task(app=app2, name=name, shared=False)(body)
    assert t1.identity((1,), {})[0] != t2.identity((1,), {})[0]


# -- arguments never appear in key names ---------------------------------------------------


def test_arguments_never_appear_in_redis_key_names(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    marker = "zebra-unicorn-7f3a91"
    calls: list[str] = []
    eager = make_app()

    @singleton_task(app=eager, name=unique("tests.secretive"), shared=False)
    def remember(secret: str, extra: dict[str, str]) -> str:
        calls.append(secret)
        return "ok"

    assert remember.delay(marker, {marker: marker}).get() == "ok"
    assert remember.apply_async((marker, {}), idempotency_key=marker).get() == "ok"
    # A publish with dedupe writes a queued marker too (and the broker its own keys).
    publisher = make_app(eager=False)

    @singleton_task(app=publisher, name=unique("tests.pub"), dedupe_on_publish=True, shared=False)
    def queued(secret: str) -> str:
        return secret

    queued.delay(marker)

    names = [n.decode() for n in redis_client.scan_iter(match="*", count=1000)]
    assert calls == [marker, marker]
    assert any(n.startswith("jobfence:job:") for n in names), names
    assert any(n.startswith("jobfence:queued:") for n in names), names
    for name in names:
        assert marker not in name, name
    key, _ = remember.identity((marker, {marker: marker}), {})
    assert f"jobfence:job:{{{key}}}" in names


def test_key_names_are_task_name_and_a_digest() -> None:
    key = job_key(SECRET, "billing.charge", bind_arguments(charge, (1, 100), {}))
    name, digest = key.split(":")
    assert name == "billing.charge"
    assert len(digest) == 40 and all(c in "0123456789abcdef" for c in digest)


# -- what cannot be a key ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (datetime.datetime(2024, 1, 1), "datetime"),
        (decimal.Decimal("1.5"), "Decimal"),
        ({1, 2}, "set"),
        (b"raw", "bytes"),
        (object(), "object"),
    ],
)
def test_non_json_arguments_are_refused_naming_the_problem(value: Any, type_name: str) -> None:
    with pytest.raises(ArgumentsNotSerializable) as info:
        key_of(charge, 1, 100, note=value)
    text = str(info.value)
    assert "JSON-serialisable" in text
    assert type_name in text  # the cause names the offending type
    assert isinstance(info.value, TypeError)  # callers catching TypeError still work


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused(value: float) -> None:
    with pytest.raises(ArgumentsNotSerializable, match="JSON-serialisable") as info:
        key_of(charge, 1, value)
    assert isinstance(info.value.cause, ValueError)
    with pytest.raises(ArgumentsNotSerializable):
        canonical_json({"nested": [value]})


def test_arguments_not_matching_the_signature_are_a_type_error_like_a_plain_call() -> None:
    with pytest.raises(TypeError) as plain:
        charge(1, amount=1, bogus=2)  # type: ignore[call-arg]
    with pytest.raises(BadArguments) as unknown:
        bind_arguments(charge, (1,), {"amount": 1, "bogus": 2})
    assert str(unknown.value) == str(plain.value)  # charge() got an unexpected keyword argument
    assert "'bogus'" in str(unknown.value)
    assert not isinstance(unknown.value, ArgumentsNotSerializable)  # nothing is unserialisable
    assert isinstance(unknown.value, TypeError) and isinstance(unknown.value, JobfenceError)
    missing = r"^shop\.charge\(\) missing a required argument: 'account'"
    with pytest.raises(BadArguments, match=missing):
        bind_arguments(charge, (), {"amount": 1}, name="shop.charge")


def test_publish_refuses_non_json_arguments_before_anything_is_sent(
    make_app: AppFactory, redis_client: redis.Redis
) -> None:
    app = make_app(eager=False)

    @singleton_task(app=app, name=unique("tests.refuse"), shared=False)
    def job(when: Any) -> None:
        return None

    with pytest.raises(ArgumentsNotSerializable, match="datetime"):
        job.delay(datetime.datetime(2024, 1, 1))
    assert redis_client.llen("celery") == 0


# -- *args and **kwargs ------------------------------------------------------------------


def test_var_args_and_kwargs_are_bound_stably() -> None:
    def f(a: int, *rest: int, **opts: int) -> None:
        return None

    assert bind_arguments(f, (1, 2, 3), {"x": 4}) == {"a": 1, "rest": [2, 3], "x": 4}
    assert key_of(f, 1, 2, x=4, y=5) == key_of(f, 1, 2, y=5, x=4)
    assert key_of(f, 1, 2) != key_of(f, 1, x=2)


def test_keyword_named_like_var_positional_does_not_collide() -> None:
    """f(1) and f(args=[1]) are different calls and must not share a key (found bug)."""

    def f(*args: Any, **kwargs: Any) -> None:
        return None

    assert key_of(f, 1) != key_of(f, args=[1])
    assert key_of(f, kwargs={"args": [1]}) != key_of(f, args=[1])


def test_keyword_shadowing_a_positional_only_parameter_is_kept() -> None:
    """f(1, a=2) binds a=1 plus a keyword 'a'; flattening used to overwrite a (found bug)."""

    def f(a: int, /, **kw: int) -> None:
        return None

    assert key_of(f, 1, a=2) != key_of(f, 2)
    assert bind_arguments(f, (1,), {"a": 2})["a"] == 1


# -- canonical JSON ----------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _reordered(value: Any, rng: random.Random) -> Any:
    """The same value with every dict's insertion order shuffled."""
    if isinstance(value, dict):
        items = [(k, _reordered(v, rng)) for k, v in value.items()]
        rng.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [_reordered(v, rng) for v in value]
    return value


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), json_values, max_size=6), seed=st.integers())
def test_canonical_json_ignores_dict_order(value: dict[str, Any], seed: int) -> None:
    shuffled = _reordered(value, random.Random(seed))
    assert canonical_json(shuffled) == canonical_json(value)
    assert job_key(SECRET, "t", shuffled) == job_key(SECRET, "t", value)
    assert json.loads(canonical_json(value)) == value


@settings(max_examples=100, deadline=None)
@given(a=json_values, b=json_values)
def test_canonical_json_distinguishes_different_values(a: Any, b: Any) -> None:
    if json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
        assert canonical_json(a) != canonical_json(b)


# -- errors name the argument, never its value ------------------------------------------


class Colour(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    ("kwargs", "where", "problem", "fix"),
    [
        (
            {"note": datetime.datetime(2031, 7, 4, 12, 0)},
            "argument 'note' of shop.charge: ",
            "datetime is not JSON-serialisable",
            "pass an ISO string",
        ),
        (
            {"note": decimal.Decimal("1234.5678")},
            "argument 'note' of shop.charge: ",
            "Decimal is not JSON-serialisable",
            "integer cents",
        ),
        (
            {"note": {"lines": [{"sku": "a"}, {"when": datetime.date(2031, 7, 4)}]}},
            "argument 'note' of shop.charge (at note.lines[1].when): ",
            "date is not JSON-serialisable",
            "ISO string",
        ),
        (
            {"note": {"user-9876@mail.example": {1234}}},
            "argument 'note' of shop.charge (at note[…]): ",
            "set is not JSON-serialisable",
            "sorted list",
        ),
        ({"note": Colour.RED}, "argument 'note' of shop.charge: ", "Colour", "pass its .value"),
        ({"amount": math.nan}, "argument 'amount' of shop.charge: ", "NaN", "finite number"),
    ],
)
def test_a_non_json_argument_is_named_without_its_value(
    kwargs: dict[str, Any], where: str, problem: str, fix: str
) -> None:
    arguments = bind_arguments(charge, (), {"account": 1, "amount": 100, **kwargs})
    with pytest.raises(ArgumentsNotSerializable) as refused:
        identity(SECRET, "shop.charge", arguments)
    text = str(refused.value)
    assert text.startswith(where + problem), text
    assert fix in text
    for shown in ("2031", "1234", "user-9876", "red", "sku"):
        assert shown not in text, text
    assert isinstance(refused.value, TypeError) and isinstance(refused.value, BadArguments)


def test_a_key_selector_result_that_is_not_json_names_the_selector() -> None:
    arguments = bind_arguments(charge, (1, 100), {})
    with pytest.raises(ArgumentsNotSerializable, match=r"the key selector of shop\.charge"):
        job_key(SECRET, "shop.charge", arguments, selector=lambda **kw: {"at": object()})


def test_key_as_one_string_means_that_one_argument() -> None:
    one = key_of(charge, 1, 100, selector="account")
    assert one == key_of(charge, 1, 999, "USD", selector="account")
    assert one == key_of(charge, 1, 5, selector=["account"])
    assert one != key_of(charge, 2, 100, selector="account")


def test_task_errors_sit_under_jobfence_error_but_never_under_lock_error() -> None:
    from jobfence.config import JobfenceError
    from jobfence.locks import LockError
    from jobfence.tasks import DuplicateJob, IdempotencyConflict, TaskError

    for error in (IdempotencyConflict, DuplicateJob, TaskError):
        assert issubclass(error, JobfenceError)
        assert not issubclass(error, LockError), f"except LockError would catch {error}"


def _three(a: int, b: int = 2, c: int = 3) -> None: ...


@given(
    args=st.lists(st.integers(), max_size=4),
    kwargs=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(), max_size=3),
)
def test_the_plain_signature_shortcut_binds_as_signature_bind_does(
    args: list[int], kwargs: dict[str, int]
) -> None:
    """bind_arguments' shortcut for plain parameters (issue 33: the publish and the gate
    bind every call) gives Signature.bind's arguments, in its order, or its error."""
    sig = inspect.signature(_three)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        with pytest.raises(TypeError):
            bind_arguments(_three, args, kwargs)
        return
    bound.apply_defaults()
    got = bind_arguments(_three, args, kwargs)
    assert list(got.items()) == list(bound.arguments.items())
