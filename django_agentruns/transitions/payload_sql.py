"""SQL of the values kept out of the run row (`RunPayload`, issue #29's narrow hot row)
that the hot path's statements (`rawsql`) carry: each claimed run's input returned by the
claim, and the successes' outputs written by the statement that settles them (its form
without events adds `settling.insert_outputs`). Nothing here executes a statement."""

from __future__ import annotations

from ..models import RunPayload
from ..payloads import INPUT_JSON

# Each claimed run's input (its latest input payload, NULL: none), in the claim's
# RETURNING, so that starting it reads nothing more; `AgentRun.input` decodes it on first
# read (runs_from sets the column as an attribute).
INPUT_OF_CLAIMED = (
    f"(SELECT p.value FROM django_agentruns_runpayload p "
    f"WHERE p.run_id = django_agentruns_agentrun.id AND p.kind = '{RunPayload.INPUT}' "
    f"ORDER BY p.id DESC LIMIT 1) AS {INPUT_JSON}")

# The settled runs' outputs, from the `v` rows of their JSON and the `done` CTE of the
# fenced UPDATE: a CTE of the settle's statement (PostgreSQL). Its one parameter: the time.
OUTPUTS_FROM_DONE = (
    f"INSERT INTO django_agentruns_runpayload (run_id, kind, value, created_at) "
    f"SELECT done.id, '{RunPayload.OUTPUT}', o.run_output, %s FROM done "
    f"JOIN v o ON o.run_id = done.id WHERE o.run_output IS NOT NULL")

