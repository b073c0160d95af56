"""An approval answers a proposal: `approve` / `reject` of a key the run never asked to be
approved raise a clear error and write nothing; a second answer is ALREADY_DELIVERED;
`deliver` still stores what comes early (webhooks do)."""

from __future__ import annotations

import pytest

from django_agentruns import DeliverResult, InvalidInputError, approve, deliver, enqueue, reject
from django_agentruns.models import AgentRun, RunEvent, RunWait, Status
from tests.test_approvals import burst, proposing

pytestmark = pytest.mark.django_db(transaction=True)


def written(run: AgentRun) -> tuple[list[tuple[str, object]], list[str]]:
    """Everything an answer could write: the run's wait rows and its events."""
    waits = list(RunWait.objects.filter(run=run).order_by("id").values_list("key",
                                                                            "delivered_at"))
    events = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("type",
                                                                             flat=True))
    return waits, events


def test_an_answer_to_a_key_never_proposed_names_the_awaited_key_and_writes_nothing() -> None:
    run = proposing()
    before = written(run)
    with pytest.raises(InvalidInputError, match=r"approval of 'refnd'.*approval of 'refund'"):
        approve(run.pk, "refnd", by="ops")
    with pytest.raises(InvalidInputError, match=r"'refund'"):
        reject(run.pk, "typo", by="ops", note="no")
    assert written(run) == before
    assert AgentRun.objects.get(pk=run.pk).status == Status.WAITING
    assert approve(run.pk, "refund", by="ops") is DeliverResult.DELIVERED


def test_an_approval_before_the_proposal_is_refused() -> None:
    run = enqueue("tests.approves", {"amount": 5})  # queued: it has proposed nothing yet
    with pytest.raises(InvalidInputError, match="asks for no approval now"):
        approve(run.pk, "refund", by="ops")
    assert not RunWait.objects.filter(run=run).exists()
    assert not RunEvent.objects.filter(run=run).exists()


def test_an_approval_of_an_input_wait_points_to_deliver() -> None:
    run = enqueue("tests.waits", {"key": "answer"})
    burst()
    with pytest.raises(InvalidInputError, match=r"waits for input 'answer'.*deliver\(\)"):
        approve(run.pk, "answer", by="ops")
    assert RunWait.objects.get(run=run).delivered_at is None
    assert deliver(run.pk, "answer", {"ok": True}) is DeliverResult.DELIVERED


def test_a_second_answer_is_already_delivered_and_changes_nothing() -> None:
    run = proposing()
    assert reject(run.pk, "refund", by="first", note="no") is DeliverResult.DELIVERED
    after_first = written(run)
    assert approve(run.pk, "refund", by="second") is DeliverResult.ALREADY_DELIVERED
    assert reject(run.pk, "refund", by="third") is DeliverResult.ALREADY_DELIVERED
    assert written(run) == after_first
    burst()
    assert AgentRun.objects.get(pk=run.pk).output["by"] == "first"


def test_deliver_still_stores_an_early_payload() -> None:
    run = enqueue("tests.waits", {"key": "hook"})
    assert deliver(run.pk, "hook", {"early": True}) is DeliverResult.STORED
    burst()
    assert AgentRun.objects.get(pk=run.pk).output == {"got": {"early": True}}


def test_an_answer_to_a_finished_run_that_never_asked_is_refused() -> None:
    run = enqueue("tests.noop")
    burst_default()
    assert AgentRun.objects.get(pk=run.pk).status == Status.SUCCEEDED
    with pytest.raises(InvalidInputError, match="is succeeded and asks for no approval"):
        approve(run.pk, "refund", by="ops")


def burst_default() -> None:
    from django_agentruns.runtime.worker import Worker

    Worker(queues=["default"], burst=True, reap_interval=0).run(install_signals=False)
