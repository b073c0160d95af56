"""The deliver_agentrun permission: answering a run's input wait from the admin."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("django_agentruns", "0007_stream_chunks"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="agentrun",
            options={
                "ordering": ("-id",),
                "permissions": (
                    ("retry_agentrun", "Can retry failed or cancelled runs"),
                    ("cancel_agentrun", "Can cancel queued or running runs"),
                    ("approve_agentrun", "Can approve or reject what a waiting run proposes"),
                    ("deliver_agentrun", "Can deliver input a waiting run asks for"),
                ),
            },
        ),
    ]
