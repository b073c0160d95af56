"""The chaos suite: real worker processes, real faults, and the guarantees checked after.

`harness` runs it (workers SIGKILLed about once a second, frozen, SIGTERMed, PostgreSQL
restarted, a `reap` loop, cancellations) with the worker processes of `workers`, the mix
of runs and the report of `plan` and the helpers of `support`; `invariants` checks what
the database holds afterwards (one run at a time with `run_checks`, waits with `waits`),
`test_chaos` runs it in CI, and ``python -m tests.chaos`` runs it by hand:

    python -m tests.chaos --runs 2000 --workers 4
"""
