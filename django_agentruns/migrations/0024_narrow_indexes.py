# Cheaper enqueues (issue #29): the indexes Django made for three foreign keys held a row
# for every run, though nearly none has a parent or an origin, and the payload table's
# `agentruns_payload_kind` (run, kind, id) already leads with the run. The run table's two
# become partial on the key being set (`agentruns_parent`, `agentruns_forked_from`): a new
# run inserts into neither; the payload table's own goes. The foreign keys themselves are
# left as they are (no constraint is dropped or validated again, no SQLite table rebuilt).
# Imports nothing of the package's live code.

import django.db.models.deletion
from django.db import migrations, models

# Django's names for the foreign keys' indexes (made by 0001 and 0020).
FK_INDEXES = (
    ("django_agentruns_agentrun_parent_id_af342159", "django_agentruns_agentrun", "parent_id"),
    ("django_agentruns_agentrun_forked_from_id_b43dd60a", "django_agentruns_agentrun",
     "forked_from_id"),
    ("django_agentruns_runpayload_run_id_17a1121f", "django_agentruns_runpayload", "run_id"),
)


def drop_fk_indexes(apps, schema_editor):
    q = schema_editor.connection.ops.quote_name
    for name, _, _ in FK_INDEXES:
        schema_editor.execute(f"DROP INDEX IF EXISTS {q(name)}")


def make_fk_indexes(apps, schema_editor):
    q = schema_editor.connection.ops.quote_name
    for name, table, column in FK_INDEXES:
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {q(name)} ON {q(table)} ({q(column)})")


class Migration(migrations.Migration):

    dependencies = [
        ("django_agentruns", "0023_partitioned_history_no_foreign_key"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="agentrun",
                    name="forked_from",
                    field=models.ForeignKey(
                        blank=True, db_index=False, help_text="The run this one was forked from "
                        "(`fork`), starting at one of its checkpoints.", null=True,
                        on_delete=django.db.models.deletion.SET_NULL, related_name="forks",
                        to="django_agentruns.agentrun"),
                ),
                migrations.AlterField(
                    model_name="agentrun",
                    name="parent",
                    field=models.ForeignKey(
                        blank=True, db_index=False, null=True,
                        on_delete=django.db.models.deletion.SET_NULL, related_name="children",
                        to="django_agentruns.agentrun"),
                ),
                migrations.AlterField(
                    model_name="runpayload",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE,
                        related_name="+", to="django_agentruns.agentrun"),
                ),
            ],
            database_operations=[migrations.RunPython(drop_fk_indexes, make_fk_indexes)],
        ),
        migrations.AddIndex(
            model_name="agentrun",
            index=models.Index(condition=models.Q(("parent__isnull", False)), fields=["parent"],
                               name="agentruns_parent"),
        ),
        migrations.AddIndex(
            model_name="agentrun",
            index=models.Index(condition=models.Q(("forked_from__isnull", False)),
                               fields=["forked_from"], name="agentruns_forked_from"),
        ),
    ]
