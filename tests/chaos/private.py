"""The chaos on a private PostgreSQL server, for the scenario that restarts a real server.

`on_private_server()` starts a throwaway server (tests/private_postgres.py), migrates a
database on it, points this process's default connection at it for the duration (the
harness's own reads and checks go there too) and yields the workers' environment and the
server, whose `restart()` the harness calls. The machine's server is never touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connections

from tests import helpers
from tests.private_postgres import PrivateServer, server_bindir


@contextmanager
def on_private_server(name: str = "agentruns_chaos") -> Iterator[tuple[dict[str, str],
                                                                       PrivateServer]]:
    bindir = server_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) for a private server")
    server = PrivateServer(bindir)
    conn = connections["default"]
    saved = dict(conn.settings_dict)
    try:
        server.start()
        settings = server.create_database(name)
        env = helpers.subprocess_env(settings)
        migrated = helpers.run_manage(["migrate", "-v", "0"], env, timeout=300)
        assert migrated.returncode == 0, migrated.stderr
        conn.close()
        conn.settings_dict.update({key: settings[key] for key in
                                   ("NAME", "USER", "HOST", "PORT")}, PASSWORD="")
        yield env, server
    finally:
        helpers.close_all_started()  # workers first: they hold sessions on the server
        conn.close()
        conn.settings_dict.clear()
        conn.settings_dict.update(saved)
        server.stop()
