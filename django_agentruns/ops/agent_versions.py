"""Which agent versions unfinished runs started under, and whether this code resumes them.

Read-only: for `manage.py agentruns_versions` and the system check that warns of runs
left for a worker with older code (docs/steps.md, "Versions").
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count

from ..models import UNFINISHED, AgentRun
from ..registry import find_agent

RUNS = "runs"
MIGRATES = "migrates"
NEWER = "newer"
PINNED = "pinned"
UNREGISTERED = "unregistered"


@dataclass(frozen=True)
class VersionRow:
    """The unfinished runs of one agent at one version, and what this code does with them."""

    agent: str
    version: int
    runs: int
    registered: int | None  # the version registered here; None: the agent is not
    verdict: str  # RUNS, MIGRATES, NEWER (a newer worker runs them), PINNED, UNREGISTERED

    @property
    def explained(self) -> str:
        return {
            RUNS: "runs here",
            MIGRATES: f"resumes here after migrate({self.version} -> {self.registered})",
            NEWER: f"newer than version {self.registered} here: a newer worker runs them",
            PINNED: f"version {self.registered} here has no migrate: they wait for a worker "
                    f"with version {self.version}",
            UNREGISTERED: "agent not registered here",
        }[self.verdict]


def unfinished_versions() -> list[VersionRow]:
    """Per agent and version, the unfinished runs (one grouped COUNT)."""
    rows = (AgentRun.objects.filter(status__in=UNFINISHED).order_by()
            .values_list("agent", "agent_version").annotate(n=Count("id")))
    return sorted((_row(agent, version, n) for agent, version, n in rows),
                  key=lambda r: (r.agent, r.version))


def _row(agent: str, version: int, runs: int) -> VersionRow:
    spec = find_agent(agent)
    if spec is None:
        return VersionRow(agent, version, runs, None, UNREGISTERED)
    if version == spec.version:
        verdict = RUNS
    elif version > spec.version:
        verdict = NEWER
    else:
        verdict = MIGRATES if spec.migrate is not None else PINNED
    return VersionRow(agent, version, runs, spec.version, verdict)
