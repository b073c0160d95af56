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


# --------------------------------------------------------------------------- LangGraph threads

def graph_rows(thread_id: str) -> tuple[int, int]:
    from django_agentruns.history_models import GraphCheckpoint, GraphWrite

    return (GraphCheckpoint.objects.filter(thread_id=thread_id).count(),
            GraphWrite.objects.filter(thread_id=thread_id).count())


def test_erase_deletes_and_counts_a_graph_thread_only_its_run_wrote_and_keeps_a_shared_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("langgraph")
    from django_agentruns.history_models import GraphCheckpoint
    from django_agentruns.runtime.worker import Worker
    from django_agentruns.streaming import transport

    monkeypatch.setattr(transport, "PRUNE_DELAY", 0.0)
    alone = django_agentruns.enqueue("tests.langgraph_thread", {"n": 1})
    first = django_agentruns.enqueue("tests.langgraph_thread", {"n": 1, "thread": "conv-7"})
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    second = django_agentruns.enqueue("tests.langgraph_thread", {"n": 5, "thread": "conv-7"})
    Worker(burst=True, reap_interval=0).run(install_signals=False)
    assert [AgentRun.objects.get(pk=r.pk).output for r in (alone, first, second)] == [2, 2, 6]
    own = f"agentrun-{alone.pk}"
    checkpoints, writes = graph_rows(own)
    assert checkpoints >= 2
    shared_before = graph_rows("conv-7")

    report = erase(alone.pk, by="dpo")
    assert graph_rows(own) == (0, 0)
    assert (report.rows["graphcheckpoint"], report.rows["graphwrite"]) == (checkpoints, writes)

    # conv-7 is written by two runs: erasing one keeps every row, without its link.
    report = erase(first.pk, by="dpo")
    assert (report.rows["graphcheckpoint"], report.rows["graphwrite"]) == (0, 0)
    assert graph_rows("conv-7") == shared_before
    assert not GraphCheckpoint.objects.filter(run_id=first.pk).exists()
    assert GraphCheckpoint.objects.filter(thread_id="conv-7", run_id=second.pk).exists()

    # Now only rows with no run (the erased one's) and second's: still shared, still kept.
    erase(second.pk)
    assert graph_rows("conv-7") == shared_before


def test_erase_keeps_a_thread_written_outside_a_run_too() -> None:
    from django_agentruns.history_models import GraphCheckpoint, GraphWrite

    run = finished_run()

    def checkpoint(thread: str, number: int, by: AgentRun | None) -> None:
        GraphCheckpoint.objects.create(thread_id=thread, checkpoint_id=f"c{number}", run=by,
                                       type="json", checkpoint=b"{}", metadata_type="json",
                                       metadata=b"{}")
        GraphWrite.objects.create(thread_id=thread, checkpoint_id=f"c{number}", task_id="t",
                                  idx=0, channel="x", type="json", value=b"1")

    checkpoint("mine", 1, run)
    checkpoint("mine", 2, run)
    checkpoint("app", 1, None)  # the application's own use of the thread
    checkpoint("app", 2, run)
    report = erase(run.pk)
    assert (report.rows["graphcheckpoint"], report.rows["graphwrite"]) == (2, 2)
    assert graph_rows("mine") == (0, 0)
    assert graph_rows("app") == (2, 2)
    assert not GraphCheckpoint.objects.filter(run_id=run.pk).exists()
