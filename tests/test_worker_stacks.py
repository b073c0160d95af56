"""`kill -USR1 <pid>` makes a worker print every thread's stack and go on serving: how an
operator (and a test whose worker does not stop) sees where a worker is stuck."""

from __future__ import annotations

import signal

import pytest

from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_sigusr1_prints_every_threads_stack_and_the_worker_goes_on(
        worker_env: dict[str, str]) -> None:
    with helpers.start_manage(["runworker"], worker_env) as worker:
        helpers.wait_until(lambda: "serving queues" in worker.stderr, message="the worker up")
        worker.send_signal(signal.SIGUSR1)
        helpers.wait_until(lambda: "most recent call first" in worker.stderr,
                           message=f"the stacks\n{worker.output()}")
        helpers.wait_until(lambda: "in _serve" in worker.stderr,
                           message=f"the claim loop's frame\n{worker.output()}")
        assert worker.popen.poll() is None, worker.output()  # still serving
        assert worker.stop() == 0, worker.output()
