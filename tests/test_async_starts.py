"""Async attempts start on the executor's loop, a claim's together: one hand-over (one
wake-up of the loop) per claim, not one per run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, Status
from django_agentruns.runtime import running, worker
from django_agentruns.runtime.running import Live, Starting
from django_agentruns.runtime.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of attempts in each hand-over to the executor's loop, in order."""
    counts: list[int] = []

    def counting(started: Sequence[Starting], done: Any) -> None:
        counts.append(len(started))
        running.spawn(started, done)

    monkeypatch.setattr(worker, "spawn", counting)
    return counts


def test_a_claims_async_attempts_reach_the_loop_in_one_hand_over(handed: list[int]) -> None:
    ids = [enqueue("tests.async_steps", {"steps": 2, "sleep": 0.2}).pk for _ in range(8)]
    Worker(concurrency=8, burst=True, reap_interval=0).run(install_signals=False)
    assert set(AgentRun.objects.filter(pk__in=ids).values_list("status", flat=True)) \
        == {Status.SUCCEEDED}
    assert sum(handed) == 8
    assert handed[0] == 8, handed  # the first claim took all eight: one hand-over


def test_an_error_escaping_an_attempts_coroutine_reaches_its_done_callback() -> None:
    """`spawn` gives each attempt's end (its task) to `done`: the worker logs what escaped
    (nothing should), as it does for a thread's."""
    ended: list[tuple[object, asyncio.Future[None]]] = []

    async def fine() -> None:
        return None

    async def broken() -> None:
        raise RuntimeError("escaped")

    async def main() -> None:
        first, second = cast(Live, object()), cast(Live, object())
        running.spawn([(first, fine()), (second, broken())],
                      lambda live, task: ended.append((live, task)))
        while len(ended) < 2:
            await asyncio.sleep(0)

    asyncio.run(main())
    assert [task.exception() is None for _, task in ended] == [True, False]
    assert str(ended[1][1].exception()) == "escaped"


@pytest.mark.parametrize("configured", [None, 10])
def test_a_claim_takes_at_most_claim_batch_runs_however_many_slots_are_free(
    handed: list[int], settings: Any, configured: int | None,
) -> None:
    """A worker with 150 free slots fills them 64 runs a claim (the default), or as many
    as `CLAIM_BATCH` says."""
    if configured is not None:
        settings.AGENTRUNS = {**settings.AGENTRUNS, "CLAIM_BATCH": configured}
    for _ in range(150):
        enqueue("tests.async_steps", {"steps": 1, "sleep": 0.05})
    Worker(concurrency=150, burst=True, reap_interval=0).run(install_signals=False)
    assert AgentRun.objects.filter(status=Status.SUCCEEDED).count() == 150
    batch = configured or 64
    assert sum(handed) == 150
    assert max(handed) == batch, handed
    assert handed[0] == batch, handed
