"""Run the chaos harness by hand, with larger numbers than CI:

    python -m tests.chaos --runs 2000 --workers 4
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/agentruns python -m tests.chaos --runs 2000

It creates its own database (``<test database>_chaos``: a SQLite file under .tmp/, or a
PostgreSQL database next to DATABASE_URL's), runs the harness, prints the summary line and
every violation, drops the database (unless ``--keep``) and exits 1 if anything was violated.
"""

from __future__ import annotations

import argparse
import os
import sys

from django.conf import settings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--workers", type=int, default=3, help="chaos worker processes")
    parser.add_argument("--concurrency", type=int, default=4, help="per worker")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="longest chaos phase; it ends earlier once every run settled")
    parser.add_argument("--kill-every", type=float, default=1.0)
    parser.add_argument("--freeze-every", type=float, default=6.0, help="0: no freezes")
    parser.add_argument("--cancel-every", type=float, default=4.0, help="0: no cancels")
    # "cluster" (a real restart) is the pytest scenario's, on a private server it starts:
    # by hand, against DATABASE_URL's server, only the database's sessions are ended.
    parser.add_argument("--pg-restart", choices=("terminate", "none"),
                        default=os.environ.get("CHAOS_PG_RESTART", "terminate"))
    parser.add_argument("--no-sigterm", action="store_true")
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.db import connection

    from tests import helpers
    from tests.chaos.harness import Chaos
    from tests.chaos.plan import ChaosConfig

    db = settings.DATABASES["default"]
    test = db.setdefault("TEST", {})
    if connection.vendor == "sqlite":
        test["NAME"] = str(helpers.TMP_DIR / f"chaos-{os.getpid()}.sqlite3")
    else:
        test["NAME"] = f"{test.get('NAME') or 'test_' + db['NAME']}_chaos"
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    config = ChaosConfig(runs=args.runs, workers=args.workers, concurrency=args.concurrency,
                         seed=args.seed, chaos_seconds=args.seconds,
                         kill_every=args.kill_every, freeze_every=args.freeze_every,
                         cancel_every=args.cancel_every, pg_restart=args.pg_restart,
                         sigterm=not args.no_sigterm, drain_workers=args.workers,
                         drain_timeout=args.drain_timeout)
    try:
        report = Chaos(config, helpers.subprocess_env(connection.settings_dict)).run()
    finally:
        helpers.close_all_started()
        if args.keep:
            print(f"kept the database {connection.settings_dict['NAME']}", file=sys.stderr)
        else:
            connection.creation.destroy_test_db(db["NAME"], verbosity=0)
    for violation in report.violations:
        print(f"VIOLATION: {violation}")
    print(report.details())
    print(report.summary())
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
