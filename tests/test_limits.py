"""Size and count caps (guarantee 11): input, output, checkpoint state,
event payload and events per run are checked before anything is written, and one
oversized or refused success never takes the worker's other successes down with it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from django_agentruns import LimitExceeded, RunRequest, enqueue, enqueue_many, run_now
from django_agentruns import checks as agentruns_checks
from django_agentruns.conf import Defaults
from django_agentruns.models import AgentRun, Reason, RunEvent, Status
from django_agentruns.runtime.worker import Worker
from tests import helpers
from tests.settings import AGENTRUNS as TEST_SETTINGS
from tests.test_settle_many import drop_refusal, refuse_output
from tests.testapp.models import SideEffect

MIB = 1_048_576


def limits(**values: int) -> Any:
    return override_settings(AGENTRUNS={**TEST_SETTINGS, **values})


def drain() -> None:
    Worker(burst=True, reap_interval=0).run(install_signals=False)


def json_size(value: Any) -> int:
    return len(json.dumps(value))


def test_the_defaults_fit_agents() -> None:
    assert (Defaults.MAX_INPUT_BYTES, Defaults.MAX_OUTPUT_BYTES, Defaults.MAX_STATE_BYTES,
            Defaults.MAX_EVENT_BYTES, Defaults.MAX_EVENTS_PER_RUN) == (
        MIB, MIB, MIB, 256 * 1024, 10_000)


# --------------------------------------------------------------------------- input


@pytest.mark.django_db
def test_an_input_over_the_cap_is_refused_naming_the_setting() -> None:
    at_cap = {"blob": "x" * (MIB - json_size({"blob": ""}))}
    assert json_size(at_cap) == MIB
    assert enqueue("tests.noop", at_cap).input == at_cap
    with pytest.raises(LimitExceeded, match=r"1048577 bytes .* limit of 1048576 bytes "
                                            r"\(AGENTRUNS\['MAX_INPUT_BYTES'\]\)"):
        enqueue("tests.noop", {"blob": at_cap["blob"] + "y"})
    with pytest.raises(LimitExceeded, match="MAX_INPUT_BYTES"):
        enqueue_many([RunRequest("tests.noop", {"n": 1}),
                      RunRequest("tests.noop", {"blob": "é" * MIB})])  # escaped: 6 bytes each
    assert AgentRun.objects.count() == 1


@pytest.mark.django_db
def test_the_input_cap_is_a_setting() -> None:
    with limits(MAX_INPUT_BYTES=20):
        enqueue("tests.noop", {"text": "x" * 8})
        with pytest.raises(LimitExceeded, match="limit of 20 bytes"):
            enqueue("tests.noop", {"text": "x" * 9})


# --------------------------------------------------------------------------- output and state


@pytest.mark.django_db(transaction=True)
def test_an_output_over_the_cap_dead_letters_the_run_not_retryable() -> None:
    big = enqueue("tests.sized", {"big": MIB})
    fits = enqueue("tests.sized", {"big": MIB - 20})
    drain()
    run = AgentRun.objects.get(pk=big.pk)
    assert (run.status, run.reason, run.output) == (Status.FAILED, Reason.NOT_RETRYABLE, None)
    assert run.error_type == "django_agentruns.exceptions.LimitExceeded"
    assert "Output of agent 'tests.sized' is 1048588 bytes as JSON, over the limit of " \
           "1048576 bytes (AGENTRUNS['MAX_OUTPUT_BYTES'])" in run.error_message
    assert SideEffect.objects.filter(run_id=big.pk).count() == 1, "not retried"
    assert AgentRun.objects.get(pk=fits.pk).status == Status.SUCCEEDED


@pytest.mark.django_db
def test_run_now_raises_the_output_cap() -> None:
    with limits(MAX_OUTPUT_BYTES=100), pytest.raises(LimitExceeded, match="MAX_OUTPUT_BYTES"):
        run_now("tests.sized", {"big": 100})


@pytest.mark.django_db(transaction=True)
def test_a_state_over_the_cap_is_refused_and_the_run_dead_lettered() -> None:
    with limits(MAX_STATE_BYTES=200):
        ok = enqueue("tests.emitter", {"events": 1, "checkpoints": 1, "state": 150})
        big = enqueue("tests.emitter", {"events": 2, "checkpoints": 2, "state": 200})
        drain()
    assert AgentRun.objects.get(pk=ok.pk).status == Status.SUCCEEDED
    run = AgentRun.objects.get(pk=big.pk)
    assert (run.status, run.reason) == (Status.FAILED, Reason.NOT_RETRYABLE)
    assert "Checkpoint state is" in run.error_message
    assert "AGENTRUNS['MAX_STATE_BYTES']" in run.error_message
    assert (run.checkpoint_state, run.checkpoint_count) == (None, 0), "nothing written"


# --------------------------------------------------------------------------- events


@pytest.mark.django_db
def test_an_event_payload_over_the_cap_is_refused() -> None:
    with limits(MAX_EVENT_BYTES=100):
        run_now("tests.emitter", {"events": 1, "size": 50})
        with pytest.raises(LimitExceeded, match=r"Payload of event 'step' .*MAX_EVENT_BYTES"):
            run_now("tests.emitter", {"events": 1, "size": 100})
    run = AgentRun.objects.filter(agent="tests.emitter").latest("pk")
    assert not RunEvent.objects.filter(run=run, type="step").exists()


@pytest.mark.django_db
def test_a_run_takes_at_most_max_events_per_run_events() -> None:
    with limits(MAX_EVENTS_PER_RUN=5):
        # run.started is the first of the stream: four emits fill it.
        assert run_now("tests.emitter", {"events": 4}) == {"emitted": 4}
        with pytest.raises(LimitExceeded, match=r"holds 5 events, the most "
                                                r"AGENTRUNS\['MAX_EVENTS_PER_RUN'\] allows"):
            run_now("tests.emitter", {"events": 5})
    run = AgentRun.objects.filter(agent="tests.emitter").latest("pk")
    types = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("type", flat=True))
    assert types == ["run.started", "step", "step", "step", "step", "run.dead_lettered"], \
        "the run's own transitions are recorded past the cap"


@pytest.mark.django_db
def test_checkpoints_past_the_events_cap_save_state_without_a_marker() -> None:
    with limits(MAX_EVENTS_PER_RUN=5):
        assert run_now("tests.emitter", {"events": 3, "checkpoints": 1}) == {"emitted": 3}
        run = AgentRun.objects.filter(agent="tests.emitter").latest("pk")
        assert list(RunEvent.objects.filter(run=run).order_by("seq").values_list(
            "type", flat=True)) == ["run.started", "step", "run.checkpoint", "step", "step",
                                    "run.succeeded"]
        # A full stream: the checkpoint is saved, its marker left out.
        assert run_now("tests.resumable", {"steps": 5}) == {"steps": 5}
        run = AgentRun.objects.filter(agent="tests.resumable").latest("pk")
        assert (run.checkpoint_state, run.checkpoint_count) == ({"step": 5}, 5)
        assert RunEvent.objects.filter(run=run, type="run.checkpoint").count() == 4


@pytest.mark.django_db(transaction=True)
def test_a_retry_re_emitting_into_a_full_stream_is_not_refused() -> None:
    """A retry resuming from the same checkpoint re-emits the same ids: they add nothing,
    so a full stream takes them without complaint; only a new event is refused."""
    with limits(MAX_EVENTS_PER_RUN=4):
        run = enqueue("tests.emit_resume", {"succeed_on": 2})
        drain()
    # Attempt 1: started, a, checkpoint, b (full), then a retryable failure. Attempt 2
    # resumes after the checkpoint: re-emits b (stored already), then c is refused.
    run.refresh_from_db()
    assert (run.status, run.reason, run.attempt) == (Status.FAILED, Reason.NOT_RETRYABLE, 2)
    assert "the event 'c' was not recorded" in run.error_message
    assert list(RunEvent.objects.filter(run=run, type__in="abc").values_list(
        "type", flat=True)) == ["a", "b"]


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("key", ["MAX_INPUT_BYTES", "MAX_OUTPUT_BYTES", "MAX_STATE_BYTES",
                                 "MAX_EVENT_BYTES", "MAX_EVENTS_PER_RUN"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "1024", None, True, 2**40])
def test_a_bad_cap_is_a_system_check_error(key: str, value: Any) -> None:
    with override_settings(AGENTRUNS={key: value}):
        messages = agentruns_checks.check_settings()
    assert [m.id for m in messages] == [agentruns_checks.E003_BAD_NUMBER]
    assert re.search(rf"\['{key}'\] must be a (whole )?number", messages[0].msg)


@pytest.mark.parametrize("key", ["MAX_INPUT_BYTES", "MAX_EVENTS_PER_RUN"])
def test_a_sound_cap_passes_the_checks(key: str) -> None:
    with override_settings(AGENTRUNS={key: 64}):
        assert agentruns_checks.check_settings() == []


# --------------------------------------------------------------------------- real workers


def open_gate() -> None:
    SideEffect.objects.create(run_id=0, note="open")


def run_together(env: dict[str, str], requests: list[RunRequest]) -> tuple[
        list[AgentRun], helpers.ManageProcess]:
    """Start a worker at concurrency 8, let it start every run, then let them all finish
    at once: their successes reach the group commit together."""
    worker = helpers.start_manage(["runworker", "--concurrency", "8"], env)
    runs = enqueue_many(requests)
    helpers.wait_until(lambda: SideEffect.objects.filter(run_id__gt=0).count() >= len(runs),
                       timeout=60, message=f"all runs to start\n{worker.output()}")
    open_gate()
    return runs, worker


@pytest.mark.slow
def test_a_worker_settles_its_other_runs_once_beside_an_oversized_output(
        worker_env: dict[str, str]) -> None:
    good = [RunRequest("tests.sized", {"n": i, "wait": 30}) for i in range(6)]
    runs, worker = run_together(worker_env, [*good[:3], RunRequest(
        "tests.sized", {"big": 2 * MIB, "wait": 30}), *good[3:]])
    big = runs[3]
    with worker:
        helpers.wait_until(lambda: AgentRun.objects.filter(
            status__in=[Status.SUCCEEDED, Status.FAILED]).count() == len(runs),
            timeout=60, message=f"every run to finish\n{worker.output()}")
        assert worker.stop() == 0
    for run in AgentRun.objects.filter(pk__in=[r.pk for r in runs]):
        assert SideEffect.objects.filter(run_id=run.pk).count() == 1, f"run {run.pk} re-ran"
        assert run.attempt == 1
        if run.pk == big.pk:
            assert (run.status, run.reason, run.output) == (
                Status.FAILED, Reason.NOT_RETRYABLE, None)
            assert "AGENTRUNS['MAX_OUTPUT_BYTES']" in run.error_message
        else:
            assert run.status == Status.SUCCEEDED
            assert run.output == {"n": run.input["n"], "tag": ""}


@pytest.fixture
def refusing_database(worker_env: dict[str, str]) -> Iterator[dict[str, str]]:
    refuse_output("refuse-me")
    yield worker_env
    drop_refusal()


@pytest.mark.slow
def test_a_success_the_database_refuses_is_retried_alone(
        refusing_database: dict[str, str]) -> None:
    """A batch failed by one member (here a trigger refusing its output) is written again
    one success at a time: the others succeed once, and none is run a second time."""
    requests = [RunRequest("tests.sized", {"n": i, "wait": 30, "tag": "refuse-me" if i == 2
                                           else ""}) for i in range(7)]
    runs, worker = run_together(refusing_database, requests)
    refused = runs[2]
    good = [r.pk for r in runs if r.pk != refused.pk]
    with worker:
        helpers.wait_until(lambda: AgentRun.objects.filter(
            pk__in=good, status=Status.SUCCEEDED).count() == len(good),
            timeout=60, message=f"the other runs to succeed\n{worker.output()}")
        helpers.wait_until(lambda: "output refused" in worker.stderr, timeout=60,
                           message="the refused write to be reported")
        assert worker.stop() == 0
        log = worker.stderr
    for pk in good:
        assert SideEffect.objects.filter(run_id=pk).count() == 1, f"run {pk} re-ran"
        assert f"run {pk}: recording the outcome failed" not in log
    assert f"run {refused.pk}: recording the outcome failed" in log
    assert AgentRun.objects.get(pk=refused.pk).status != Status.SUCCEEDED
