"""A throwaway PostgreSQL server of the test's own, for tests that restart the server.

The shared server at 127.0.0.1:5432 is never restarted (other tests and other people use
it). `PrivateServer` runs `initdb` into a temporary directory and starts the server on a
free port with the local server binaries (/usr/lib/postgresql/<version>/bin, as Debian and
Ubuntu install them, or `pg_config --bindir`), as the `postgres` user when run as root.
`start_replica` adds a streaming replica of it (`pg_basebackup -R` with a replication
slot: standby.signal and primary_conninfo), on a free port of its own, in the same
temporary directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from tests import helpers


def server_bindir() -> Path | None:
    """Where initdb and pg_ctl are: the newest /usr/lib/postgresql/<v>/bin, else pg_config's."""
    root = Path("/usr/lib/postgresql")
    if root.is_dir():
        versions = sorted((p for p in root.iterdir() if (p / "bin" / "initdb").exists()),
                          key=lambda p: [int(x) for x in p.name.split(".") if x.isdigit()])
        if versions:
            return versions[-1] / "bin"
    if shutil.which("pg_config"):
        found = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                               check=False).stdout.strip()
        if found and (Path(found) / "initdb").exists():
            return Path(found)
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateServer:
    def __init__(self, bindir: Path, root: Path | None = None, name: str = "data") -> None:
        self.bindir = bindir
        self.port = free_port()
        self._owns_root = root is None  # a replica lives in its primary's directory
        self.root = root or Path(tempfile.mkdtemp(prefix="agentruns-pg-"))
        self.data = self.root / name
        self.log = self.root / f"{name}.log"
        self._as_postgres = os.geteuid() == 0  # initdb refuses to run as root
        if self._as_postgres and self._owns_root:
            shutil.chown(self.root, user="postgres", group="postgres")

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        command = [str(self.bindir / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                  "--no-sync", "-E", "UTF8")
        self._pg_ctl("start")

    def start_replica(self, slot: str = "agentruns_replica") -> PrivateServer:
        """A hot standby streaming from this server (wal_level=replica, the default), from
        a `pg_basebackup` that creates its replication slot and writes standby.signal and
        primary_conninfo (-R). Stop it before this server."""
        replica = PrivateServer(self.bindir, root=self.root, name="replica")
        self._run("pg_basebackup", "-D", str(replica.data), "-h", "127.0.0.1",
                  "-p", str(self.port), "-U", "postgres", "-R", "-X", "stream", "-C",
                  "-S", slot, "--no-sync")
        replica._pg_ctl("start")
        return replica

    def replayed_up_to_primary(self, primary: PrivateServer) -> bool:
        """Whether this replica has replayed everything `primary` has written so far."""
        with psycopg.connect(**primary.params(), autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert row is not None
        with psycopg.connect(**self.params(), autocommit=True) as conn:
            done = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
                                [str(row[0])]).fetchone()
        return bool(done and done[0])

    def _pg_ctl(self, action: str, *extra: str) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   f"-c fsync=off -c max_connections=100 -c wal_level=replica")
        self._run("pg_ctl", action, "-D", str(self.data), "-l", str(self.log), "-w",
                  "-o", options, *extra)

    def restart(self) -> None:
        """A real restart: every session gets "terminating connection due to administrator
        command", and the server refuses connections until it is back."""
        self._pg_ctl("restart", "-m", "fast")
        helpers.wait_until(self.answers, timeout=60, interval=0.1,
                           message="the private server to answer after its restart")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")
        finally:
            if self._owns_root:
                shutil.rmtree(self.root, ignore_errors=True)

    def params(self, dbname: str = "postgres") -> dict[str, Any]:
        return {"host": "127.0.0.1", "port": self.port, "user": "postgres", "dbname": dbname}

    def answers(self) -> bool:
        try:
            psycopg.connect(**self.params(), connect_timeout=2).close()
        except psycopg.Error:
            return False
        return True

    def create_database(self, name: str) -> dict[str, Any]:
        """Create `name`; return a Django-style settings dict naming it."""
        with psycopg.connect(**self.params(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return {"ENGINE": "django.db.backends.postgresql", "NAME": name, "USER": "postgres",
                "HOST": "127.0.0.1", "PORT": str(self.port)}
