"""@singleton_task(global_rate_limit=...): options refused at decoration, the limiter key,
eager calls waiting for their turn, and backends without the capability refused."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from jobfence.config import Settings
from jobfence.locks import Capabilities, MemoryBackend, RateLimitUnsupported
from jobfence.tasks import (
    RateLimitSkipped,
    Runtime,
    TaskDefinitionError,
    install,
    runtime_for,
    singleton_task,
)
from jobfence.worker.checks import check_rate_limits
from tests.tasks.conftest import AppFactory, unique


def _charge(account: str, amount: int) -> int:
    return amount


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"global_rate_limit": "100"}, 'global_rate_limit must be "N/s", "N/m" or "N/h"'),
        ({"global_rate_limit": "100/d"}, 'global_rate_limit must be "N/s", "N/m" or "N/h"'),
        ({"global_rate_limit": 100}, 'global_rate_limit must be "N/s", "N/m" or "N/h"'),
        ({"global_rate_limit": "5/s", "rate_burst": 0}, "rate_burst must be a whole number"),
        ({"global_rate_limit": "5/s", "on_rate_limited": "drop"}, "on_rate_limited must be"),
        ({"global_rate_limit": "5/s", "rate_key": ["acount"]}, "rate_key names 'acount'"),
        ({"rate_key": ["account"]}, "rate_key is given without global_rate_limit"),
    ],
)
def test_bad_rate_options_are_refused_at_decoration(
    make_app: AppFactory, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(TaskDefinitionError, match=message.replace("(", r"\(")):
        singleton_task(app=make_app(), name=unique("tests.rated"), shared=False, **options)(
            _charge
        )


def test_eager_calls_wait_for_their_turn_on_one_limiter_per_rate_key(
    make_app: AppFactory,
) -> None:
    app = make_app()
    task = singleton_task(
        app=app, name=unique("tests.rated"), shared=False, global_rate_limit="4/s",
        rate_key="account",
    )(_charge)  # fmt: skip
    began = time.monotonic()
    assert [task.delay("a", n).get() for n in range(3)] == [0, 1, 2]  # 0.25 s apart
    assert task.delay("b", 9).get() == 9  # another account: its own limiter, no wait
    assert 0.45 <= time.monotonic() - began < 2.0
    keys = [k for k in runtime_for(app).backend.client.scan_iter("*:rate:*")]  # type: ignore[attr-defined]
    assert len(keys) == 4  # one limiter per account (its turns and its starts) ...
    assert all(task.name in k and "account" not in k for k in keys)  # ... named by a digest


def test_skip_stops_with_rate_limit_skipped_without_running(make_app: AppFactory) -> None:
    app = make_app()
    runs: list[int] = []

    def body(n: int) -> int:
        runs.append(n)
        return n

    task = singleton_task(
        app=app, name=unique("tests.rated"), shared=False, global_rate_limit="1/m",
        on_rate_limited="skip",
    )(body)  # fmt: skip
    assert task.delay(1).get() == 1
    with pytest.raises(RateLimitSkipped) as caught:
        task.delay(2)
    assert caught.value.marker == {"jobfence": "rate_limited"}
    assert 55 < caught.value.retry_after <= 60
    assert runs == [1]


class _NoRates(MemoryBackend):
    name: ClassVar[str] = "norates"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=False, ha=False, release_notify=True
    )


def test_a_backend_without_rate_limits_is_refused_at_start_up_and_at_first_use(
    make_app: AppFactory,
) -> None:
    app = make_app(installed=False)
    runtime = install(app, Runtime(Settings(lock_url="memory://"), backend=_NoRates()))
    task = singleton_task(app=app, name=unique("tests.rated"), shared=False,
                          global_rate_limit="5/s")(_charge)  # fmt: skip
    findings = list(check_rate_limits(runtime, [task]))
    assert [f.setting for f in findings] == [f"task {task.name} global_rate_limit"]
    assert findings[0].refuse and "keeps no shared rate limits" in findings[0].problem
    assert not list(check_rate_limits(SimpleNamespace(backend=MemoryBackend()), [task]))  # type: ignore[arg-type]
    with pytest.raises(RateLimitUnsupported, match="global_rate_limit='5/s', but the norates"):
        task.delay("a", 1)
