"""A private PgBouncer (Debian's `pgbouncer`, transaction pooling) in front of the test server.

Started on a free port with a config in a temporary directory, never the system service:
tests, `scripts/test-pgbouncer.sh` and the bench route a database through it to see what a
production deployment behind a transaction pooler sees.

    python -m tests.pgbouncer start 127.0.0.1:5432   # prints the port; runs until killed
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

BINARY_PATHS = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")
INSTALL_HINT = "apt-get install -y pgbouncer (Debian's package; the service need not run)"


def binary() -> str | None:
    """The pgbouncer executable, or None if it is not installed."""
    found = shutil.which("pgbouncer")
    return found or next((p for p in BINARY_PATHS if os.access(p, os.X_OK)), None)


def required() -> bool:
    """In CI (or with REQUIRE_PGBOUNCER=1) a missing pgbouncer fails instead of skipping."""
    return bool(os.environ.get("REQUIRE_PGBOUNCER") or os.environ.get("CI"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """One pgbouncer process in transaction mode, every database forwarded to one server.

    `restart()` stops it (clients lose their connections, as in a real restart) and
    starts it again on the same port.
    """

    def __init__(self, server_host: str = "127.0.0.1", server_port: int = 5432,
                 port: int | None = None, pool_size: int = 20) -> None:
        exe = binary()
        if exe is None:
            raise FileNotFoundError(f"pgbouncer is not installed: {INSTALL_HINT}")
        self.exe = exe
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="agentruns-pgbouncer-"))
        self.ini = self.dir / "pgbouncer.ini"
        self.log = self.dir / "pgbouncer.log"
        # `* =`: any database name (pytest's test_* databases too) goes to the same server.
        self.ini.write_text(f"""[databases]
* = host={server_host} port={server_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir / "userlist.txt"}
admin_users = postgres
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 500
server_idle_timeout = 5
ignore_startup_parameters = extra_float_digits,options
logfile = {self.log}
pidfile = {self.dir / "pgbouncer.pid"}
""")
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')
        self._user: list[str] = []
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                pw = pwd.getpwnam("nobody")
            user = pw.pw_name
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            self._user = ["-u", user]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> PgBouncer:
        self.process = subprocess.Popen([self.exe, *self._user, str(self.ini)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not start on port {self.port}:\n"
                                   f"{self.log_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """SIGTERM: an immediate shutdown, every client connection dropped."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _answers(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                   timeout=0.5):
            return True
        return False

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def route(self, url: str) -> str:
        """`url` (a postgres:// URL of the server behind) through this pgbouncer instead."""
        parts = urlsplit(url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def kill_database(self, name: str) -> None:
        self.kill_on(self.port, name)

    @staticmethod
    def kill_on(port: int, name: str) -> None:
        """Drop the server connections pgbouncer (at `port`) holds to `name`, so that the
        database can be dropped; harmless if it has none."""
        import psycopg

        with contextlib.suppress(psycopg.Error), psycopg.connect(
                host="127.0.0.1", port=port, user="postgres", dbname="pgbouncer",
                autocommit=True) as admin:
            admin.execute(f'KILL "{name}"')
            admin.execute(f'RESUME "{name}"')  # else new clients of `name` would wait

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "start":
        print(__doc__, file=sys.stderr)
        return 2
    host, _, port = argv[1].rpartition(":")
    bouncer = PgBouncer(host or "127.0.0.1", int(port or 5432)).start()
    print(bouncer.port, flush=True)

    def leave(signum: int, frame: object) -> None:
        bouncer.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    while bouncer.process is not None and bouncer.process.poll() is None:
        time.sleep(0.5)
    bouncer.close()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
