"""Finished runs NOTIFY only when someone waits for them (PostgreSQL).

A committed NOTIFY wakes every LISTENing session of the database, whatever its channel, and
each woken session runs a transaction of its own to read the queue: one NOTIFY per finished
run cost every worker's listener a transaction per run (a drain counted 3 commits per run
with one worker, 6 with four). `wait_for_run` / `await_run` now write the runs they wait for
into an unlogged table (`agentruns_finish_watch`, no model: only the waiters' listener and
this trigger use it), and the finish trigger NOTIFYs only for those. Nothing on SQLite.
"""

from django.db import migrations

FINISHED_CHANNEL = "agentruns_finished"  # django_agentruns.streaming.waiters.FINISHED_CHANNEL
WATCH_TABLE = "agentruns_finish_watch"  # django_agentruns.streaming.waiters.WATCH_TABLE


class FinishWatch(migrations.operations.base.Operation):
    """The watch table and the trigger function that reads it (PostgreSQL only)."""

    reversible = True

    def state_forwards(self, app_label, state):
        pass

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in [
            f"""CREATE UNLOGGED TABLE IF NOT EXISTS {WATCH_TABLE} (
                    run_id bigint NOT NULL,
                    watcher text NOT NULL,
                    created_at timestamptz NOT NULL DEFAULT now(),
                    PRIMARY KEY (run_id, watcher))""",
            f"""CREATE OR REPLACE FUNCTION agentruns_notify_finished() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    IF EXISTS (SELECT 1 FROM {WATCH_TABLE} WHERE run_id = NEW.id) THEN
                        PERFORM pg_notify('{FINISHED_CHANNEL}', NEW.id::text);
                    END IF;
                    RETURN NULL;
                END $$""",
        ]:
            schema_editor.execute(statement)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return
        for statement in [
            f"""CREATE OR REPLACE FUNCTION agentruns_notify_finished() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM pg_notify('{FINISHED_CHANNEL}', NEW.id::text);
                    RETURN NULL;
                END $$""",
            f"DROP TABLE IF EXISTS {WATCH_TABLE}",
        ]:
            schema_editor.execute(statement)

    def describe(self):
        return f"PostgreSQL: finished runs NOTIFY {FINISHED_CHANNEL} only when in {WATCH_TABLE}"


class Migration(migrations.Migration):

    dependencies = [
        ('django_agentruns', '0011_flow_windows'),
    ]

    operations = [FinishWatch()]
