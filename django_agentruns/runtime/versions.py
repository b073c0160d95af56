"""Runs in flight across deploys: a run of an older agent version, claimed by newer code
that has a `migrate`, gets its checkpoint state migrated before the agent sees it.

The claim takes only runs this code may run (`registry.claimable_version`); here the
attempt's first write, fenced, stores the migrated state and the new version, so the
agent resumes from state its own version understands.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .. import transitions
from ..models import AgentRun
from ..registry import AgentSpec
from ..validation import capped_json

if TYPE_CHECKING:
    from .control import AttemptControl


def needs_upgrade(run: AgentRun, spec: AgentSpec | None) -> bool:
    return spec is not None and spec.migrate is not None and run.agent_version < spec.version


def upgrade(run: AgentRun, spec: AgentSpec, control: AttemptControl) -> None:
    """Migrate the run's state to `spec.version` (agent code: its error fails the attempt,
    classified like the agent's own), then write it fenced."""
    assert spec.migrate is not None
    state = spec.migrate(run.checkpoint_state, run.agent_version)
    capped_json(state, f"State migrated by agent {spec.name!r}", "MAX_STATE_BYTES")
    control.apply(control.call(functools.partial(
        transitions.migrate_version, control.ref, state, spec.version, run.agent_version)))
    run.checkpoint_state, run.agent_version = state, spec.version
