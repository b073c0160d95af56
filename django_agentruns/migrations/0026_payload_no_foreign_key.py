# The payload table carries no database foreign key to the run table on plain history
# either (issue #29): a partitioned one never had it (0023), and PostgreSQL checked it for
# every input an enqueue writes, about a tenth of a bulk enqueue's cost. Purge and erase
# delete a run's payload rows themselves (ops.retention), as on partitioned history, and
# an ORM delete of a run still collects them (the field stays a ForeignKey). Imports
# nothing of the live code.

import django.db.models.deletion
from django.db import migrations, models

PAYLOADS = "django_agentruns_runpayload"
RUNS = "django_agentruns_agentrun"


def field(constraint: bool) -> models.ForeignKey:
    return models.ForeignKey(db_constraint=constraint, db_index=False,
                             on_delete=django.db.models.deletion.CASCADE, related_name="+",
                             to="django_agentruns.agentrun")


def drop_foreign_key(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        q = connection.ops.quote_name
        with connection.cursor() as cursor:
            cursor.execute("SELECT conname FROM pg_constraint WHERE contype = 'f' AND "
                           "conrelid = %s::regclass AND confrelid = %s::regclass AND "
                           "conparentid = 0", [PAYLOADS, RUNS])
            for (name,) in cursor.fetchall():
                cursor.execute(f"ALTER TABLE {PAYLOADS} DROP CONSTRAINT {q(name)}")
    elif connection.vendor == "sqlite":  # a foreign key is the table's: it is remade
        _alter(apps, schema_editor, constraint=False)


def make_foreign_key(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_partitioned_table WHERE partrelid = "
                           "%s::regclass", [PAYLOADS])
            if cursor.fetchone():
                return  # partitioned history has none (0023)
            cursor.execute(f"ALTER TABLE {PAYLOADS} ADD CONSTRAINT "
                           f"{PAYLOADS}_run_id_fk_agentrun FOREIGN KEY (run_id) REFERENCES "
                           f"{RUNS} (id) DEFERRABLE INITIALLY DEFERRED NOT VALID")
            # NOT VALID: rows written without the key (a payload whose run was deleted by
            # hand) do not stop the way back; new rows are checked.
    elif connection.vendor == "sqlite":
        _alter(apps, schema_editor, constraint=True)


def _alter(apps, schema_editor, *, constraint: bool) -> None:
    """SQLite: the table remade with (or without) the key, by Django's schema editor."""
    model = apps.get_model("django_agentruns", "RunPayload")
    state = model._meta.get_field("run")
    old, new = state.clone(), state.clone()
    for one, has_key in ((old, not constraint), (new, constraint)):
        one.db_constraint = has_key
        one.set_attributes_from_name("run")
        one.model = model
        one.remote_field.model = state.remote_field.model
        one.remote_field.field_name = state.remote_field.field_name
    schema_editor.alter_field(model, old, new)


class Migration(migrations.Migration):

    dependencies = [
        ("django_agentruns", "0025_redundant_run_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(model_name="runpayload", name="run", field=field(False)),
            ],
            database_operations=[migrations.RunPython(drop_foreign_key, make_foreign_key)],
        ),
    ]
