"""PostgreSQL wakes idle workers itself: NOTIFY from triggers on the runs table.

A statement-level AFTER INSERT trigger sends one NOTIFY per distinct queue of the queued
rows a statement inserted, and a row-level AFTER UPDATE OF status trigger one for a run
an operator sends back to the queue (failed or cancelled -> queued). NOTIFY is delivered
when the transaction commits, never if it rolls back, and identical ones of a transaction
are folded into one: a bulk enqueue wakes each queue once. Any INSERT wakes workers,
`enqueue`'s or raw SQL's.

The update trigger is per row with a WHEN clause rather than per statement with
transition tables, which cannot be narrowed to a column or a condition and so would run
for every claim and settle. Both add about 5 us of server time to a one-row UPDATE
(measured); this one calls its function only for a retried run, and UPDATEs that leave
status alone (lease renewals) skip it. Requeues of a running run (a retry after backoff, a
lapsed lease) notify nobody: their own worker looks again at once, and a backoff is not
due yet. SQLite has no NOTIFY; its workers poll, and this migration does nothing there.
`manage.py sqlmigrate django_agentruns 0002` shows the SQL on PostgreSQL.
"""

from django.db import migrations

CHANNEL = "agentruns"  # the workers' wake-up channel, as it was when written; a migration
# never imports live code, which may move or change


class NotifyTriggers(migrations.operations.base.Operation):
    """Creates the triggers on PostgreSQL (drops them backwards); nothing elsewhere."""

    reversible = True

    def state_forwards(self, app_label, state):
        pass  # no model changes

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            for statement in self.create(self.table(schema_editor, to_state)):
                schema_editor.execute(statement)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            for statement in self.drop(self.table(schema_editor, from_state)):
                schema_editor.execute(statement)

    def describe(self):
        return "PostgreSQL triggers that NOTIFY workers of queued runs"

    @staticmethod
    def table(schema_editor, state):
        model = state.apps.get_model("django_agentruns", "AgentRun")
        return schema_editor.quote_name(model._meta.db_table)

    @staticmethod
    def create(table):
        return [
            f"""CREATE FUNCTION agentruns_notify_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM pg_notify('{CHANNEL}', queue)
                    FROM (SELECT DISTINCT queue FROM inserted WHERE status = 'queued') AS queues;
                    RETURN NULL;
                END $$""",
            f"""CREATE TRIGGER agentruns_notify_insert AFTER INSERT ON {table}
                REFERENCING NEW TABLE AS inserted
                FOR EACH STATEMENT EXECUTE FUNCTION agentruns_notify_inserted()""",
            f"""CREATE FUNCTION agentruns_notify_requeued() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM pg_notify('{CHANNEL}', NEW.queue);
                    RETURN NULL;
                END $$""",
            f"""CREATE TRIGGER agentruns_notify_retry AFTER UPDATE OF status ON {table}
                FOR EACH ROW WHEN (NEW.status = 'queued' AND OLD.status IN ('failed', 'cancelled'))
                EXECUTE FUNCTION agentruns_notify_requeued()""",
        ]

    @staticmethod
    def drop(table):
        return [
            f"DROP TRIGGER IF EXISTS agentruns_notify_retry ON {table}",
            "DROP FUNCTION IF EXISTS agentruns_notify_requeued()",
            f"DROP TRIGGER IF EXISTS agentruns_notify_insert ON {table}",
            "DROP FUNCTION IF EXISTS agentruns_notify_inserted()",
        ]


class Migration(migrations.Migration):

    dependencies = [
        ("django_agentruns", "0001_initial"),
    ]

    operations = [
        NotifyTriggers(),
    ]
