# The run row is rewritten six times or more in a run's life (claim, each renewal, emit
# and checkpoint, settle); only the claim and the settle change an indexed column. With
# every page packed full (PostgreSQL's default fillfactor of 100), a renewal found no room
# beside its row, so the new version went to another page and into all of the table's
# indexes: a fifth of the updates were HOT. With a fifth of each page kept free, most
# renewals stay on their page (HOT: no index entry, less WAL). Only pages written from now
# on keep the room; existing rows turn over as runs are purged. PostgreSQL only; SQLite
# has no fillfactor. Imports nothing of the live code.

from django.db import migrations

RUNS = "django_agentruns_agentrun"
FILLFACTOR = 80


def keep_room(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {RUNS} SET (fillfactor = {FILLFACTOR})")


def pack_full(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {RUNS} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("django_agentruns", "0026_payload_no_foreign_key")]

    operations = [migrations.RunPython(keep_room, pack_full, elidable=False)]
