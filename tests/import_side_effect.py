"""A module outside INSTALLED_APPS whose import is observable: no worker may import it
because a run's input names it (tests/test_tasks_backend.py)."""

import tests

tests.import_side_effect_ran = True  # type: ignore[attr-defined]


def anything() -> None:
    """What a crafted run's input points at."""
