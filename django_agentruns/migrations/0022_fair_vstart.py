# Fair shares by stamped virtual starts (issue #28): a run's `fair_vstart`, stamped at
# enqueue, and the two indexes the claim and enqueue read (transitions.fair). The claim no
# longer reads or writes the groups, so `agentruns_fair_due` (its per-group read) goes.
# The runs queued, waiting or running now are stamped in the order the fair claim took
# them: within each (queue, fair_key, priority), its group's virtual time plus its rank
# (weight 1: a migration reads no live settings; a running run ranks first, as it started
# first). Imports nothing of the package's live code.

from django.db import migrations, models

RUNS = "django_agentruns_agentrun"
GROUPS = "django_agentruns_fairgroup"
BATCH = 1000


def stamp_queued(apps, schema_editor):
    """Each unfinished run's stamp: its group's time plus its rank in the group."""
    connection = schema_editor.connection
    q = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT r.id, COALESCE(g.vtime, 0) + ROW_NUMBER() OVER (PARTITION BY r.queue, "
            f"r.fair_key, r.priority ORDER BY CASE r.status WHEN 'running' THEN 0 ELSE 1 END, "
            f"r.available_at, r.fired_seq, r.id) "
            f"FROM {RUNS} r LEFT JOIN {GROUPS} g ON g.queue = r.queue AND g.{q('key')} = "
            f"r.fair_key WHERE r.status IN ('queued', 'waiting', 'running')")
        stamps = cursor.fetchall()
        for i in range(0, len(stamps), BATCH):
            cursor.executemany(f"UPDATE {RUNS} SET fair_vstart = %s WHERE id = %s",
                               [(float(stamp), pk) for pk, stamp in stamps[i:i + BATCH]])


class Migration(migrations.Migration):

    dependencies = [
        ("django_agentruns", "0021_narrow_input_output"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="agentrun",
            name="agentruns_fair_due",
        ),
        migrations.AddField(
            model_name="agentrun",
            name="fair_vstart",
            field=models.FloatField(default=0.0, db_default=0.0),
        ),
        migrations.RunPython(stamp_queued, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name="agentrun",
            index=models.Index(condition=models.Q(("status", "queued")),
                               fields=["queue", "-priority", "fair_vstart", "available_at",
                                       "fired_seq", "id"], name="agentruns_fair_order"),
        ),
        migrations.AddIndex(
            model_name="agentrun",
            index=models.Index(condition=models.Q(("status", "queued")),
                               fields=["queue", "fair_key", "priority", "fair_vstart"],
                               name="agentruns_fair_last"),
        ),
        migrations.AddIndex(
            model_name="agentrun",
            index=models.Index(condition=models.Q(("status", "running"),
                                                  models.Q(("fair_key", ""), _negated=True)),
                               fields=["queue", "fair_vstart"], name="agentruns_fair_running"),
        ),
    ]
