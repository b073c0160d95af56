"""System checks that read the database (asked with `--database`, as `migrate` does) or
probe the deployment: runs pinned to an agent version nobody serves, and the history
partitions' setting and layout. Registered by importing this module (`checks` does)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from ..conf import SETTING_NAME, app_settings

W009_PINNED_VERSIONS = "agentruns.W009"
E020_BAD_HISTORY_PARTITION = "agentruns.E020"
W020_HISTORY_LAYOUT = "agentruns.W020"


@register(Tags.database)
def check_pinned_versions(app_configs: Any = None, databases: Any = None,
                          **kwargs: Any) -> list[CheckMessage]:
    """Unfinished runs of an older agent version that the code here cannot resume (no
    `migrate`): only a worker with their version claims them. Asked only with databases
    (`manage.py check --database default`, `migrate`)."""
    if not databases:
        return []
    from .agent_versions import PINNED, unfinished_versions

    try:
        rows = [r for r in unfinished_versions() if r.verdict == PINNED]
    except Exception:  # not migrated yet, or no database to read: nothing to say
        return []
    return [Warning(f"{row.runs} unfinished run(s) of {row.agent!r} started under version "
                    f"{row.version}; version {row.registered} registered here has no migrate, "
                    f"so no worker with this code claims them.",
                    hint=f"Keep a worker with version {row.version} of {row.agent!r} running "
                         f"until they finish, or give @agent a migrate(state, from_version).",
                    id=W009_PINNED_VERSIONS) for row in rows]


@register()
def check_history_partition(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from .partitions import setting_problem

    raw = getattr(settings, SETTING_NAME, None)
    problem = setting_problem(raw.get("HISTORY_PARTITION")) if isinstance(raw, dict) else None
    return [Error(f"{SETTING_NAME}['HISTORY_PARTITION'] {problem}.",
                  hint="Run ids per partition, e.g. 1_000_000 (docs/history.md).",
                  id=E020_BAD_HISTORY_PARTITION)] if problem else []


@register(Tags.database)
def check_history_layout(app_configs: Any = None, databases: Any = None,
                         **kwargs: Any) -> list[CheckMessage]:
    """The history tables' layout against HISTORY_PARTITION: a setting changed after
    `migrate`. Asked only with databases (`migrate`, `check --database default`)."""
    if not databases:
        return []
    from .partitions import layout_problems, setting_problem

    if setting_problem(app_settings.HISTORY_PARTITION):
        return []  # E020 says it
    try:
        found = layout_problems()
    except Exception:  # not migrated yet, or no database to read
        return []
    return [Warning(problem, hint=hint, id=W020_HISTORY_LAYOUT) for problem, hint in found]
