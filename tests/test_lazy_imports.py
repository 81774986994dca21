"""Importing jobfence loads only what the import needs: `jobfence.locks` neither Celery,
redis-py nor SQLAlchemy, and `@singleton_task` on Redis locks no SQL library (each import in
a fresh interpreter)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

HEAVY = ("celery", "kombu", "redis", "sqlalchemy", "pydantic", "psycopg", "pymysql", "kazoo",
         "opentelemetry")  # fmt: skip
# redis-py 8 imports opentelemetry itself where it is installed; jobfence only when a
# runtime's executor is built (tasks/tracing.py).
REDIS = {"redis", "opentelemetry"}


def loaded_after(statement: str) -> set[str]:
    """The heavy top-level packages a fresh interpreter holds after running `statement`."""
    code = (
        f"import json, sys\n{statement}\n"
        "top = {m.split('.')[0] for m in sys.modules}\n"
        f"print(json.dumps(sorted(top & set({list(HEAVY)!r}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize(
    ("statement", "allowed"),
    [
        ("import jobfence", set()),
        ("import jobfence.locks", set()),
        ("from jobfence.locks import Locker, MemoryBackend, LeaseKeeper, StaleFence", set()),
        ("from jobfence.config import JobfenceError, UnsafeSettings", set()),
        ("from jobfence.config import Settings", {"pydantic"}),
        ("from jobfence.locks import RedisBackend, open_backend", REDIS | {"pydantic"}),
        ("from jobfence import singleton_task", {"celery", "kombu", "pydantic"}),
        ("from jobfence import singleton_task, setup", REDIS | {"celery", "kombu", "pydantic"}),
    ],
)
def test_an_import_loads_only_the_libraries_it_needs(statement: str, allowed: set[str]) -> None:
    assert loaded_after(statement) <= allowed


def test_a_lazy_name_is_the_object_its_module_defines_and_is_listed_by_dir() -> None:
    import jobfence
    import jobfence.locks
    import jobfence.tasks
    from jobfence.locks.guards import SqlFenceGuard
    from jobfence.tasks.effects import SqlEffects

    assert jobfence.SqlFenceGuard is jobfence.locks.SqlFenceGuard is SqlFenceGuard
    assert jobfence.tasks.SqlEffects is SqlEffects
    assert {"SqlFenceGuard", "singleton_task", "setup"} <= set(dir(jobfence))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = jobfence.nothing_here  # type: ignore[attr-defined]


def test_the_sql_effects_load_sqlalchemy_when_used() -> None:
    assert "sqlalchemy" in loaded_after("from jobfence.tasks import SqlEffects")


@pytest.mark.parametrize(
    "package", ["jobfence", "jobfence.config", "jobfence.locks", "jobfence.tasks"]
)
def test_every_public_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []
