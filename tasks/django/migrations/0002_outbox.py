"""Create jobfence_outbox (publish on commit), unless jobfence's SQLAlchemy side made it first."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

TABLE = "jobfence_outbox"


def create_missing_table(apps: Any, schema_editor: Any) -> None:
    # `jobfence migrate` and SqlEffects create the same table; a project moving to Django keeps it.
    if TABLE not in set(schema_editor.connection.introspection.table_names()):
        schema_editor.create_model(apps.get_model("jobfence", "OutboxMessage"))


def drop_table(apps: Any, schema_editor: Any) -> None:
    if TABLE in set(schema_editor.connection.introspection.table_names()):
        schema_editor.delete_model(apps.get_model("jobfence", "OutboxMessage"))


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("jobfence", "0001_initial")]

    state_operations = [
        migrations.CreateModel(
            name="OutboxMessage",
            fields=[
                ("task_id", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("task_name", models.CharField(max_length=255)),
                ("payload", models.TextField()),
                ("created_at", models.FloatField()),
                ("sent_at", models.FloatField(null=True)),
                ("attempts", models.IntegerField(default=0)),
            ],
            options={
                "db_table": TABLE,
                "indexes": [
                    models.Index(fields=["sent_at", "created_at"], name="jobfence_outbox_unsent")
                ],
            },
        ),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=state_operations),
        # Not atomic: MySQL cannot roll back DDL, and Django refuses DDL inside a transaction there.
        migrations.RunPython(create_missing_table, drop_table, atomic=False),
    ]
