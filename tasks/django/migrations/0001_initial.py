"""Create jobfence_fences and jobfence_jobs, unless jobfence's SQLAlchemy side made them first."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

TABLES = {"Fence": "jobfence_fences", "JobRecord": "jobfence_jobs"}


def create_missing_tables(apps: Any, schema_editor: Any) -> None:
    # SqlEffects creates the same tables on first use; a project moving to Django keeps them.
    existing = set(schema_editor.connection.introspection.table_names())
    for model_name, table in TABLES.items():
        if table not in existing:
            schema_editor.create_model(apps.get_model("jobfence", model_name))


def drop_tables(apps: Any, schema_editor: Any) -> None:
    existing = set(schema_editor.connection.introspection.table_names())
    for model_name, table in TABLES.items():
        if table in existing:
            schema_editor.delete_model(apps.get_model("jobfence", model_name))


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True

    dependencies: list[tuple[str, str]] = []

    state_operations = [
        migrations.CreateModel(
            name="Fence",
            fields=[
                ("resource", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("fence", models.BigIntegerField()),
            ],
            options={"db_table": "jobfence_fences"},
        ),
        migrations.CreateModel(
            name="JobRecord",
            fields=[
                ("job_key", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("state", models.CharField(max_length=16)),
                ("fingerprint", models.CharField(max_length=64)),
                ("result", models.TextField()),
                ("fence", models.BigIntegerField()),
                ("finished_at", models.FloatField()),
            ],
            options={"db_table": "jobfence_jobs"},
        ),
    ]

    # The state first, so the RunPython below sees the models it creates.
    operations = [
        migrations.SeparateDatabaseAndState(state_operations=state_operations),
        # Not atomic: MySQL cannot roll back DDL, and Django refuses DDL inside a transaction there.
        migrations.RunPython(create_missing_tables, drop_tables, atomic=False),
    ]
