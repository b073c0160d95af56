"""`erase(run_id)`: one finished or cancelled run and everything it stored, gone now, in one
transaction; an unfinished run refused; who asked is in the log. The command and the
admin's bulk action (behind the delete permission) do the same."""

from __future__ import annotations

import logging
from io import StringIO

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import Client

import django_agentruns
from django_agentruns import RunNotFinishedError, erase
from django_agentruns.exceptions import InvalidInputError, RunNotFoundError
from django_agentruns.models import AgentRun, Reason, Status
from tests.test_retention_owned_rows import finished_run, give_it_everything, owned_rows

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "/admin/django_agentruns/agentrun/"


@pytest.mark.parametrize(("status", "reason"), [(Status.SUCCEEDED, Reason.COMPLETED),
                                                (Status.CANCELLED, Reason.CANCELLED),
                                                (Status.FAILED, Reason.RETRIES_EXHAUSTED)])
def test_erase_deletes_a_finished_run_and_all_it_stored_and_logs_who_asked(
        status: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    run = finished_run(status, reason, input={"email": "a@example.com"})
    give_it_everything(run)
    child = AgentRun.objects.create(agent="tests.noop", queue="default",
                                    status=Status.RUNNING, parent=run, spawn_key="c")
    other = finished_run()
    give_it_everything(other)

    with caplog.at_level(logging.INFO, logger="django_agentruns.retention"):
        report = erase(run.pk, by="dpo@example.com")

    assert not AgentRun.objects.filter(pk=run.pk).exists()
    assert owned_rows(run.pk) == 0
    assert report.rows["agentrun"] == 1
    assert report.rows["runwait"] == 2
    assert report.rows["runusage"] == 1
    assert owned_rows(other.pk) == 6  # another run's rows are untouched
    child.refresh_from_db()
    assert child.parent_id is None
    assert child.status == Status.RUNNING
    assert any(f"run {run.pk} erased by dpo@example.com" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("status", [Status.QUEUED, Status.RUNNING, Status.WAITING])
def test_erase_refuses_an_unfinished_run_and_deletes_nothing(status: str) -> None:
    run = AgentRun.objects.create(agent="tests.noop", queue="default", status=status)
    give_it_everything(run)
    with pytest.raises(RunNotFinishedError, match="cancel it first"):
        erase(run.pk)
    assert issubclass(RunNotFinishedError, InvalidInputError)
    assert AgentRun.objects.filter(pk=run.pk).exists()
    assert owned_rows(run.pk) == 6


def test_erase_of_a_missing_run_is_a_clear_error() -> None:
    with pytest.raises(RunNotFoundError):
        erase(10**9)
    assert "erase" in django_agentruns.__all__


def test_the_erase_command() -> None:
    run = finished_run()
    give_it_everything(run)
    out = StringIO()
    call_command("erase", str(run.pk), "--by", "ticket-77", stdout=out)
    assert out.getvalue().startswith(f"erased run {run.pk} (")
    assert not AgentRun.objects.filter(pk=run.pk).exists()
    running = AgentRun.objects.create(agent="tests.noop", queue="default",
                                      status=Status.RUNNING)
    with pytest.raises(CommandError, match="only a finished or cancelled run"):
        call_command("erase", str(running.pk))
    with pytest.raises(CommandError):
        call_command("erase", "nope")


def staff(username: str, *codenames: str) -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_agentruns", codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def test_the_admin_erase_action_needs_the_delete_permission() -> None:
    run = finished_run()
    post = {"action": "erase_runs", "_selected_action": [str(run.pk)], "post": "yes"}
    viewer = staff("viewer", "view_agentrun", "retry_agentrun", "cancel_agentrun")
    assert "erase_runs" not in viewer.get(CHANGELIST).content.decode()
    assert viewer.post(CHANGELIST, post).status_code == 403
    assert AgentRun.objects.filter(pk=run.pk).exists()

    eraser = staff("eraser", "view_agentrun", "delete_agentrun")
    response = eraser.post(CHANGELIST, post, follow=True)
    assert "1 run erased, stored rows and all" in response.content.decode()
    assert not AgentRun.objects.filter(pk=run.pk).exists()
    entry = LogEntry.objects.get(object_id=str(run.pk))
    assert entry.action_flag == DELETION
    assert entry.user.get_username() == "eraser"
