"""Reads from a replica (`READ_DATABASE`), against a real streaming replica this test
starts: a private primary and a `pg_basebackup` of it streaming from a replication slot
(tests/private_postgres.py). The scenario (tests/replica_scenario.py) runs in a process
whose `default` is the primary and `replica` the standby: the admin's list and overview,
`why`, the gauges and the event stream's catch-up read follow the replica (a run written to
the primary shows only once replayed, checked with replay paused), no list read touches the
primary's run table, and an action (Cancel, bulk cancel, Retry) on a run the replica shows
in a stale state acts on the primary's state. SQLite has no replica: the setting's check
and the named reads are tested in test_read_database on both."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests import helpers
from tests.private_postgres import PrivateServer, server_bindir

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


@pytest.fixture
def primary_and_replica() -> Iterator[tuple[PrivateServer, PrivateServer]]:
    bindir = server_bindir()
    if bindir is None or not (bindir / "pg_basebackup").exists():
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) here")
    primary = PrivateServer(bindir)
    replica: PrivateServer | None = None
    try:
        primary.start()
        replica = primary.start_replica()
        yield primary, replica
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def test_reads_go_to_the_replica_and_actions_to_the_primary(
    primary_and_replica: tuple[PrivateServer, PrivateServer],
) -> None:
    primary, replica = primary_and_replica
    settings = primary.create_database("agentruns")
    env = helpers.subprocess_env(settings,
                                 AGENTRUNS_TEST_REPLICA=f"127.0.0.1:{replica.port}")
    migrated = helpers.run_manage(["migrate", "-v", "0"], env, timeout=180)
    assert migrated.returncode == 0, migrated.stderr
    helpers.wait_until(lambda: replica.replayed_up_to_primary(primary), timeout=60,
                       message="the replica to replay the migrations")
    done = subprocess.run([sys.executable, "-m", "tests.replica_scenario"], env=env,
                          cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == [
        "ok", "the", "list", "reads", "from", "the", "replica",
        "ok", "reads", "follow", "replication",
        "ok", "an", "action", "re-reads", "the", "run", "on", "the", "primary",
        "ok", "a", "cancel", "follows", "the", "primary's", "state",
        "ok", "a", "retry", "follows", "the", "primary's", "state"], done.stdout
