"""Event streams are cheap and bounded: one database connection for all of a process's
streams, a cap per user and per process (429 + Retry-After), and a client that leaves
gives everything back at once.

Served by a real `runserver` subprocess (threaded WSGI, a thread per stream) and read by
real sockets; the server's database connections are counted from outside (PostgreSQL:
pg_stat_activity by application_name; SQLite: the server's open descriptors of the file).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client

from django_agentruns import cancel, enqueue
from tests import helpers

APP_NAME = "agentruns-stream-server"
CAPS = {"STREAMS_PER_USER": 3, "STREAMS_PER_PROCESS": 5}


class Stream:
    """One `GET .../events/` on its own socket: status and headers read, the body as it
    comes; closed abruptly, as a browser tab or `curl -N` that goes away."""

    def __init__(self, port: int, path: str, session: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          f"Cookie: sessionid={session}\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = self.sock.recv(65536)
            assert chunk, f"the server closed before answering: {raw!r}"
            raw += chunk
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.lower(): v.strip() for k, _, v in
                        (line.partition(":") for line in lines[1:])}
        self.eof = False

    @property
    def text(self) -> str:
        return self.body.decode()

    def read_until(self, needle: str, timeout: float = 15) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert not self.eof, f"the stream ended without {needle!r}: {self.text!r}"
            assert time.monotonic() < deadline, f"no {needle!r} within {timeout}s: {self.text!r}"
            chunk = self.sock.recv(65536)
            self.eof = not chunk
            self.body += chunk
        return self.text

    def read_to_end(self, timeout: float = 15) -> str:
        deadline = time.monotonic() + timeout
        while not self.eof:
            assert time.monotonic() < deadline, f"still open after {timeout}s: {self.text!r}"
            chunk = self.sock.recv(65536)
            self.eof = not chunk
            self.body += chunk
        return self.text

    def close(self) -> None:
        self.sock.close()


def session_of(username: str) -> str:
    user = User.objects.create_user(username, password="pw")
    user.user_permissions.set(Permission.objects.filter(
        content_type__app_label="django_agentruns", codename="view_agentrun"))
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def server(env: dict[str, str]) -> Iterator[int]:
    port = free_port()
    env = {**env, "AGENTRUNS_TEST_SETTINGS": json.dumps(CAPS)}
    if connection.vendor == "postgresql":
        env["DATABASE_URL"] += f"?application_name={APP_NAME}"
    with helpers.start_manage(["runserver", f"127.0.0.1:{port}", "--noreload",
                               "--skip-checks"], env) as process:
        def answers() -> bool:
            assert process.returncode is None, process.output()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return True

        helpers.wait_until(answers, message="runserver to listen")
        yield port


def server_connections() -> int | None:
    """The PostgreSQL connections the server process holds now (None on SQLite, whose
    connections leave no trace outside the process: a closed one's descriptor is kept
    open while another connection of the process holds a lock on the file)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                       [APP_NAME])
        return int(cursor.fetchone()[0])


def at_most(limit: int) -> Callable[[], bool]:
    def check() -> bool:
        count = server_connections()
        return count is None or count <= limit
    return check


class Served:
    """A runserver with the caps above, three users' sessions, and the streams opened."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.alice, self.bob, self.carol = (session_of(n) for n in ("alice", "bob", "carol"))
        self.baseline = server_connections() or 0  # runserver's own, from its start
        self.opened: list[Stream] = []

    def open(self, session: str, run_id: int) -> Stream:
        stream = Stream(self.port, f"/agentruns/runs/{run_id}/events/", session)
        self.opened.append(stream)
        return stream

    def open_ok(self, session: str, run_id: int) -> Stream:
        stream = self.open(session, run_id)
        assert stream.status == 200, stream.text
        stream.read_until("retry: 1000")  # the catch-up read is done and sent
        return stream


@pytest.fixture
def served(worker_env: dict[str, str]) -> Iterator[Served]:
    with server(worker_env) as port:
        served = Served(port)
        yield served
        for stream in served.opened:
            stream.close()


def quiet_run() -> int:
    return enqueue("tests.noop", run_after=3600).pk  # stays queued: no event until cancel


def test_open_streams_share_one_connection_and_all_get_each_new_event(served: Served) -> None:
    run_id = quiet_run()
    streams = [served.open_ok(user, run_id) for user in (served.alice, served.bob) * 2]

    # Four streams wait on the process's one poller, which holds one connection (and, on
    # PostgreSQL, its one LISTEN connection for live chunks); the requests gave theirs back
    # (before: a connection per stream, for up to 10 minutes).
    shared = 2 if connection.vendor == "postgresql" else 1
    helpers.wait_until(at_most(served.baseline + shared), timeout=60,
                       message="one connection (two on PostgreSQL) for all streams")

    # A new event reaches every stream, then `end`, and the server closes each.
    cancel(run_id)
    for stream in streams:
        text = stream.read_to_end()
        assert '"type":"run.cancelled"' in text
        assert text.endswith('event: end\ndata: {"status": "cancelled", '
                             '"reason": "cancelled"}\n\n')
    # With no stream open the poller (and the listener) let their connections go too.
    helpers.wait_until(at_most(served.baseline), timeout=60,
                       message="the poller to close its connection")


def test_past_a_cap_a_stream_is_refused_with_429_and_retry_after(served: Served) -> None:
    run_id = quiet_run()
    for _ in range(3):
        served.open_ok(served.alice, run_id)
    refused = served.open(served.alice, run_id)  # STREAMS_PER_USER is 3
    assert refused.status == 429
    assert int(refused.headers["retry-after"]) > 0
    assert "STREAMS_PER_USER" in refused.read_to_end()

    for _ in range(2):
        served.open_ok(served.bob, run_id)
    refused = served.open(served.carol, run_id)  # STREAMS_PER_PROCESS is 5
    assert refused.status == 429
    assert int(refused.headers["retry-after"]) > 0
    assert "STREAMS_PER_PROCESS" in refused.read_to_end()


def test_a_client_that_leaves_frees_its_slot_and_connection_at_once(served: Served) -> None:
    run_id = quiet_run()
    users = (served.alice, served.alice, served.alice, served.bob, served.carol)
    for stream in [served.open_ok(user, run_id) for user in users]:
        stream.close()  # the tab closes, or `curl -N` is stopped

    # Within a couple of heartbeats: the server holds no connection for them (before:
    # each held one until its next heartbeat failed, 15 to 30 s later) ...
    helpers.wait_until(at_most(served.baseline), timeout=60,
                       message="the connections of streams whose clients left")
    # ... and every slot is free: alice has her three again, the process its five.
    wanted = list(users)

    def all_open() -> bool:
        for user in list(wanted):
            if served.open(user, run_id).status == 200:  # a refused request holds nothing
                wanted.remove(user)
        return not wanted

    helpers.wait_until(all_open, timeout=60, interval=0.1,
                       message="the slots of streams whose clients left")
