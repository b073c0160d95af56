"""Worker records: each worker says who it is and that it is alive; `workers`, `why` read them."""

from __future__ import annotations

import io
import signal
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import DatabaseError
from django.utils import timezone

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, WorkerRecord
from django_agentruns.ops import workers
from django_agentruns.runtime.presence import Presence
from tests import helpers


class FakeWorker:
    def __init__(self, worker_id: str = "host:1:abc", queues: tuple[str, ...] = ("default",),
                 agents: tuple[str, ...] = ("tests.noop",)) -> None:
        self.worker_id = worker_id
        self.queues = list(queues)
        self.concurrency = 4
        self._agents = list(agents)

    @property
    def agent_names(self) -> list[str]:
        return self._agents


def manage(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def why(run: AgentRun) -> str:
    return manage("why", str(run.pk))


# --------------------------------------------------------------------------- the module


@pytest.mark.django_db
def test_register_beat_and_unregister() -> None:
    t0 = timezone.now() - timedelta(minutes=5)
    record = workers.register(FakeWorker(), at=t0)
    assert (record.queues, record.concurrency, record.agents) == (["default"], 4, ["tests.noop"])
    assert record.version
    assert record.pid
    assert record.host
    assert list(workers.live(t0)) == [record]
    assert list(workers.live(t0 + timedelta(seconds=2.1))) == []  # LEASE_TTL 2 s in tests
    assert workers.beat("host:1:abc", at=t0 + timedelta(seconds=2))
    assert [r.worker_id for r in workers.live(t0 + timedelta(seconds=3))] == ["host:1:abc"]
    workers.unregister("host:1:abc")
    assert not WorkerRecord.objects.exists()
    assert not workers.beat("host:1:abc")  # its record is gone: the worker registers again


@pytest.mark.django_db
def test_register_prunes_records_dead_for_a_day() -> None:
    now = timezone.now()
    workers.register(FakeWorker("old"), at=now - timedelta(days=2))
    workers.register(FakeWorker("recent"), at=now - timedelta(hours=1))
    workers.register(FakeWorker("new"), at=now)
    assert sorted(WorkerRecord.objects.values_list("worker_id", flat=True)) == ["new", "recent"]


@pytest.mark.django_db
def test_presence_beats_at_most_every_interval_and_re_registers_when_pruned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    presence = Presence(FakeWorker())
    presence.start()
    first = WorkerRecord.objects.get().last_seen_at
    presence.tick()  # too soon: no write
    assert WorkerRecord.objects.get().last_seen_at == first
    presence._last -= workers.beat_interval()
    WorkerRecord.objects.all().delete()
    presence.tick()
    assert WorkerRecord.objects.get().worker_id == "host:1:abc"


@pytest.mark.django_db
def test_presence_survives_a_database_error(monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any) -> Any:
        raise DatabaseError("the database went away")

    monkeypatch.setattr(workers, "register", broken)
    Presence(FakeWorker()).start()  # logs, does not raise
    assert "could not write worker record" in caplog.text


@pytest.mark.django_db
def test_coverage_says_which_queue_or_agent_no_live_worker_serves() -> None:
    run = enqueue("tests.noop", queue="reports")
    gap = workers.Coverage.read().gap(run)
    assert gap is not None
    assert gap.startswith("no live worker serves queue 'reports' (no worker has been seen")
    workers.register(FakeWorker(queues=("default",)))
    assert workers.Coverage.read().gap(run) == "no live worker serves queue 'reports'"
    workers.register(FakeWorker("w2", queues=("reports",), agents=("tests.steps",)))
    assert "no live worker serving queue 'reports' has agent 'tests.noop'" in str(
        workers.Coverage.read().gap(run))
    workers.register(FakeWorker("w3", queues=("reports",)))
    assert workers.Coverage.read().gap(run) is None


@pytest.mark.django_db
def test_why_names_the_missing_worker_or_agent() -> None:
    run = enqueue("tests.noop", queue="reports")
    assert f"run #{run.pk} (tests.noop) is due, but no live worker serves queue 'reports'" \
        in why(run)
    workers.register(FakeWorker(queues=("reports",), agents=("tests.steps",)))
    assert "has agent 'tests.noop'" in why(run)
    later = enqueue("tests.noop", queue="reports", run_after=3600)
    output = why(later)
    assert "is not starting:" in output
    assert "waiting until" in output
    assert "has agent 'tests.noop'" in output


@pytest.mark.django_db
def test_workers_command_lists_live_workers_and_with_all_the_gone_ones() -> None:
    workers.register(FakeWorker("alive"))
    workers.register(FakeWorker("dead"), at=timezone.now() - timedelta(minutes=10))
    listed = manage("workers")
    assert "alive  live  queues=default  concurrency=4  agents=1" in listed
    assert "dead" not in listed
    assert "dead  GONE" in manage("workers", "--all")
    WorkerRecord.objects.all().delete()
    assert manage("workers").strip() == "no live workers"


# --------------------------------------------------------------------------- real workers


@pytest.mark.slow
def test_a_real_worker_records_itself_beats_and_leaves_on_sigterm(
        worker_env: dict[str, str]) -> None:
    with helpers.start_manage(["runworker", "--queues", "default,reports",
                               "--concurrency", "3"], worker_env) as worker:
        record = helpers.wait_until(lambda: WorkerRecord.objects.filter().first(),
                                    message="the worker's record")
        assert (record.pid, record.queues, record.concurrency) == (
            worker.pid, ["default", "reports"], 3)
        assert "tests.noop" in record.agents
        helpers.wait_until(lambda: WorkerRecord.objects.get().last_seen_at > record.last_seen_at,
                           message="a beat")
        listed = helpers.run_manage(["workers"], worker_env)
        assert f"{record.worker_id}  live  queues=default,reports" in listed.stdout
        worker.send_signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.output()
    assert not WorkerRecord.objects.exists()


@pytest.mark.slow
def test_a_killed_worker_is_gone_once_a_lease_ttl_passes(worker_env: dict[str, str]) -> None:
    with helpers.start_manage(["runworker"], worker_env) as worker:
        record = helpers.wait_until(lambda: WorkerRecord.objects.first(),
                                    message="the worker's record")
        worker.kill()
        worker.wait()
    helpers.wait_until(lambda: not workers.live().exists(), timeout=60,
                       message="the record to stop counting as live")
    assert WorkerRecord.objects.get().worker_id == record.worker_id  # kept, shown as gone
    run = enqueue("tests.noop")
    assert "no live worker serves queue 'default'" in why(run)
