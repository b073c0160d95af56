"""A worker's signals: `kill -USR1 <pid>` prints every thread's stack and the worker goes
on serving (how an operator, or a test whose worker does not stop, sees where it is), and
SIGTERM stops it even when it lands while the main thread holds an Event's lock."""

from __future__ import annotations

import signal

import pytest

from tests import helpers


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sigusr1_prints_every_threads_stack_and_the_worker_goes_on(
        worker_env: dict[str, str]) -> None:
    with helpers.start_manage(["runworker"], worker_env) as worker:
        helpers.wait_until(lambda: "serving queues" in worker.stderr, message="the worker up")

        def claim_loop_frame_shown() -> bool:
            # Asked again each second: a dump that lands while the main thread pushes a
            # frame prints it as "File ???" (seen on Python 3.13), and that is no failure.
            if "in _serve" in worker.stderr:
                return True
            worker.send_signal(signal.SIGUSR1)
            return False

        helpers.wait_until(claim_loop_frame_shown, interval=1.0,
                           message=f"the claim loop's frame\n{worker.output()}")
        assert "most recent call first" in worker.stderr, worker.output()
        assert worker.popen.poll() is None, worker.output()  # still serving
        assert worker.stop() == 0, worker.output()


def test_a_signal_while_the_main_thread_holds_an_events_lock_still_stops_the_worker() -> None:
    """The handler runs between any two bytecodes: here, inside `Event.clear()` of the
    Event `stop` sets. Stopping from the handler itself would wait on that lock forever."""
    import faulthandler
    import threading

    from django_agentruns.runtime.stop_signals import StopSignals

    wake = threading.Event()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signals = StopSignals(wake.set, grace=5, worker_id="stacks:1:abcd")
    try:
        signals.install()

        def interrupted_inside_clear() -> None:
            with wake._cond:  # type: ignore[attr-defined]  # what Event.clear() holds
                signals._on_signal(signal.SIGTERM, None)

        thread = threading.Thread(target=interrupted_inside_clear, daemon=True)
        thread.start()
        thread.join(5)
        assert not thread.is_alive(), "the handler waited on a lock its thread holds"
        assert wake.wait(5), "the watcher thread did not stop the worker"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        faulthandler.unregister(signal.SIGUSR1)
