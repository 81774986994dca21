"""The task options, defined once (tasks/options.py): a typo refused, Celery's own options kept."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re
import typing
from typing import Any

import pytest
from celery import Celery

from jobfence.tasks import SingletonTask, TaskDefinitionError, singleton_task
from jobfence.tasks.options import (
    CONFLICT_POLICIES,
    DEFAULTS,
    DJANGO_CONFLICT_POLICIES,
    DJANGO_OPTION_NAMES,
    OPTION_NAMES,
    OPTIONS,
    attribute_of,
    celery_option_names,
)
from tests.tasks.conftest import unique

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "tasks" / "options.py"
#: A string equal to an option's name outside the table, and why it is no second definition.
NAMED_ELSEWHERE = {
    # The `policy` label of jobfence_conflicts_total for a duplicate inside unique_for: a
    # metric's label value, which the flow's event table owns (issue 32, item 1).
    ("tasks/events.py", "unique_for"),
}


def _app() -> Celery:
    return Celery(unique("app"), set_as_current=False)


def k(k: str) -> str:
    return k


# -- a typo is refused --------------------------------------------------------------------


def test_the_issues_typos_are_refused_naming_each_keyword_and_the_nearest_option() -> None:
    with pytest.raises(TaskDefinitionError) as refused:

        @singleton_task(key=["k"], on_conflit="raise", dedupe_on_pubish=True)
        def job(k: str) -> None: ...

    message = str(refused.value)
    assert "'on_conflit' (did you mean 'on_conflict'?)" in message
    assert "'dedupe_on_pubish' (did you mean 'dedupe_on_publish'?)" in message
    assert "neither a jobfence option nor a Celery task option" in message


def test_control_spelled_right_the_same_options_are_taken_and_kept() -> None:
    task = singleton_task(app=_app(), name=unique("t"), shared=False, key=["k"],
                          on_conflict="raise", dedupe_on_publish=True)(k)  # fmt: skip
    assert (task.on_conflict, task.dedupe_on_publish) == ("raise", True)
    assert task.jobfence_options.on_conflict == "raise"


def test_a_task_attributes_spelling_names_the_keyword() -> None:
    with pytest.raises(TaskDefinitionError, match=r"'jobfence_key' \(did you mean 'key'\?\)"):
        singleton_task(jobfence_key=["k"])


def test_a_celery_option_misspelled_is_refused_too() -> None:
    with pytest.raises(TaskDefinitionError, match=r"'retry_backof' \(did you mean 'retry_backoff'"):
        singleton_task(retry_backof=True)


def test_a_custom_attribute_of_the_base_class_passes() -> None:
    class Audited(SingletonTask):  # type: ignore[misc]
        audit_channel = "default"

    task = singleton_task(app=_app(), name=unique("t"), shared=False, base=Audited,
                          audit_channel="payments")(k)  # fmt: skip
    assert task.audit_channel == "payments"
    with pytest.raises(TaskDefinitionError, match="a custom task attribute belongs on a base"):
        singleton_task(audit_channel="payments")


# -- Celery's own options pass, the list read from Celery -----------------------------------

CELERY_OPTIONS: dict[str, Any] = {
    "bind": True, "serializer": "json", "max_retries": 3, "default_retry_delay": 1,
    "autoretry_for": (ValueError,), "dont_autoretry_for": (KeyError,), "retry_backoff": True,
    "retry_backoff_max": 30, "retry_jitter": False, "retry_kwargs": {"max_retries": 2},
    "compression": "gzip", "rate_limit": "10/s",
    "time_limit": 60, "soft_time_limit": 50, "acks_late": True, "ignore_result": False,
    "track_started": True, "typing": True, "lazy": False, "filter": None, "expires": 60,
}  # fmt: skip


def test_celerys_task_options_pass_through_unchanged() -> None:
    def charge(self: Any, k: str) -> str:
        return k

    task = singleton_task(app=_app(), name=unique("t"), shared=False, **CELERY_OPTIONS)(charge)
    for name in ("max_retries", "compression", "rate_limit", "time_limit", "track_started"):
        assert getattr(task, name) == CELERY_OPTIONS[name], name
    assert task.autoretry_for == (ValueError,)


def test_the_celery_names_are_read_from_celery_not_copied() -> None:
    names = celery_option_names(SingletonTask)
    # app.task's own keywords, _task_from_fun's, autoretry's and the execution options: each
    # found in Celery's code; a Celery that moves one shows up here, not as a refused option.
    expected = ("shared", "lazy", "filter", "name", "base", "bind", "pydantic", "autoretry_for",
                "retry_backoff_max", "queue", "exchange", "routing_key")  # fmt: skip
    for name in expected:
        assert name in names, name
    assert not names & set(OPTION_NAMES), "a jobfence option is the table's, never Celery's"
    assert "jobfence_key" not in names and "jobfence_ttl" not in names


# -- one table ------------------------------------------------------------------------------


def test_the_conflict_policies_are_defined_once_and_djangos_lack_retry_and_supersede() -> None:
    assert set(CONFLICT_POLICIES) - set(DJANGO_CONFLICT_POLICIES) == {"retry", "supersede"}
    declared = typing.get_type_hints(type(DEFAULTS))["on_conflict"]
    assert typing.get_args(declared) == CONFLICT_POLICIES


def _product_modules() -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / "tasks").rglob("*.py") if p != TABLE)


def _named(rel: str, text: str) -> list[str]:
    """Where module `rel` names an option as a string (a dict key, a getattr, a tuple of
    names), or defines a tuple of policies: a second definition of what the table has."""
    names = set(OPTION_NAMES) | {attribute_of(f) for f in OPTIONS}
    found = []
    for node in ast.walk(ast.parse(text, rel)):
        named = isinstance(node, ast.Constant) and node.value in names
        if named and (rel, node.value) not in NAMED_ELSEWHERE:
            found.append(f"{rel}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id.endswith("_POLICIES"):
                    found.append(f"{rel}:{node.lineno}: {target.id} defined again")
    return found


def test_no_option_is_named_outside_its_table() -> None:
    found = [
        line
        for path in _product_modules()
        for line in _named(path.relative_to(ROOT).as_posix(), path.read_text())
    ]
    assert not found, "option names outside tasks/options.py:\n" + "\n".join(found)


def test_control_the_scan_finds_the_spellings_this_table_replaced() -> None:
    """What tasks/django_tasks.py and tasks/celery_task.py held before the table."""
    before = """
CONFLICT_POLICIES = ("skip", "wait", "raise")
OPTION_NAMES = ("key", "ttl", "on_conflict")
options = {"jobfence_key": key, "dedupe_on_publish": dedupe_on_publish}
_check_seconds("dedupe_ttl", celery_options.get("dedupe_ttl"))
"""
    found = _named("tasks/django_tasks.py", before)
    assert len(found) == 8 and "tasks/django_tasks.py:2: CONFLICT_POLICIES defined again" in found


def _keywords(func: ast.FunctionDef) -> dict[str, Any]:
    """A typed signature's keyword-only parameters with their defaults, less `app` and `base`
    (the decorator's own)."""
    args = func.args
    pairs = zip(args.kwonlyargs, args.kw_defaults, strict=True)
    return {a.arg: ast.literal_eval(d) for a, d in pairs if d and a.arg not in ("app", "base")}


def test_the_decorators_typed_signature_lists_the_table_with_its_defaults() -> None:
    """The overload is for users' editors; it must say what the table says."""
    tree = ast.parse((ROOT / "tasks" / "celery_task.py").read_text())
    (typed,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.decorator_list
                and n.name == "singleton_task" and len(n.args.kwonlyargs) > 2]  # fmt: skip
    shown = _keywords(typed)
    assert list(shown) == list(OPTION_NAMES)
    assert shown == {f.name: f.default for f in OPTIONS}


def test_fenceds_typed_signature_lists_the_django_options() -> None:
    tree = ast.parse((ROOT / "tasks" / "django_tasks.py").read_text())
    (typed,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                and n.name == "fenced" and n.args.kwonlyargs]  # fmt: skip
    shown = _keywords(typed)
    assert list(shown) == list(DJANGO_OPTION_NAMES)
    assert shown == {f.name: f.default for f in OPTIONS if f.name in DJANGO_OPTION_NAMES}


def test_every_option_has_a_doc_line_and_the_reference_lists_them() -> None:
    page = (ROOT / "docs" / "reference" / "singleton-task.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \| (yes|) *\| (.*) \|$", page, re.M)
    assert [row[0] for row in rows] == list(OPTION_NAMES)
    for (name, default, django, doc), f in zip(rows, OPTIONS, strict=True):
        assert default == repr(f.default), name
        assert bool(django) is f.metadata["django"], name
        assert doc == f.metadata["doc"] and "|" not in doc, name


# -- the task class's attributes come from the table ---------------------------------------


def test_a_subclass_may_set_an_option_as_a_class_attribute() -> None:
    class Waiting(SingletonTask):  # type: ignore[misc]
        on_conflict = "wait"
        jobfence_ttl = 5

    assert Waiting.jobfence_options == dataclasses.replace(DEFAULTS, on_conflict="wait", ttl=5)
    assert (Waiting.on_conflict, Waiting.jobfence_ttl) == ("wait", 5)
    with pytest.raises(TaskDefinitionError, match="on_conflict must be one of"):

        class Bad(SingletonTask):  # type: ignore[misc]
            on_conflict = "sometimes"


def test_celerys_task_annotations_reach_the_options() -> None:
    app = _app()
    name = unique("t")
    app.conf.task_annotations = {name: {"on_conflict": "raise"}}
    task = singleton_task(app=app, name=name, shared=False)(k)
    assert task.jobfence_options.on_conflict == "raise" == task.on_conflict


def test_the_attributes_read_the_options() -> None:
    for f in OPTIONS:
        assert getattr(SingletonTask, attribute_of(f)) == f.default, f.name
    assert inspect.signature(singleton_task).parameters.keys() >= {"app", "base", "options"}
