"""`Metrics` builds each row of its table, and its type annotations name the same metrics."""

from __future__ import annotations

from jobfence.tasks.metrics import METRIC_TABLE, Metrics


def test_every_row_is_built_as_its_kind_under_its_name() -> None:
    metrics = Metrics()
    families = {family.name for family in metrics.registry.collect()}
    for row in METRIC_TABLE:
        metric = getattr(metrics, row.attribute)
        assert type(metric) is row.kind, row.attribute
        assert metric._labelnames == row.labels, row.attribute
        assert row.name.removesuffix("_total") in families, row.name


def test_the_annotations_type_exactly_the_tables_metrics() -> None:
    # A row added without its annotation is untyped for mypy; an annotation left without a row
    # is an attribute never built.
    annotations = Metrics.__annotations__.items()
    annotated = {name: kind for name, kind in annotations if not name.startswith("_")}
    assert annotated == {row.attribute: row.kind.__name__ for row in METRIC_TABLE}


def test_rebuild_registers_the_table_again() -> None:
    metrics = Metrics()
    metrics.conflicts.labels("t", "skip").inc()
    metrics.rebuild()
    assert metrics.conflicts.labels("t", "skip")._value.get() == 0
    assert len(list(metrics.registry.collect())) == len(METRIC_TABLE)
