"""The system checks of `HISTORY_PARTITION`: a bad span is an error; a setting that no
longer matches the tables `migrate` made is a warning naming the command that converts them."""

from __future__ import annotations

from typing import Any

import pytest

from django_agentruns.checks import check_history_layout, check_history_partition
from django_agentruns.ops import partitions

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("value", [0, 10, -5, 1.5e6, "1000000", True])
def test_a_bad_span_is_a_system_check_error(settings: Any, value: Any) -> None:
    settings.AGENTRUNS = {"HISTORY_PARTITION": value}
    errors = check_history_partition()
    assert [e.id for e in errors] == ["agentruns.E020"]
    assert "HISTORY_PARTITION" in errors[0].msg


@pytest.mark.parametrize("value", [None, 1000, 1_000_000])
def test_good_spans_pass(settings: Any, value: Any) -> None:
    settings.AGENTRUNS = {"HISTORY_PARTITION": value}
    assert check_history_partition() == []


@pytest.mark.postgres_only
def test_a_setting_changed_after_migrate_is_a_warning(settings: Any) -> None:
    settings.AGENTRUNS = {"HISTORY_PARTITION": 1000}
    [plain] = check_history_layout(databases=["default"])
    assert plain.id == "agentruns.W020"
    assert "partitions convert" in plain.hint
    partitions.convert(1000)
    assert check_history_layout(databases=["default"]) == []
    settings.AGENTRUNS = {"HISTORY_PARTITION": 2000}
    [other] = check_history_layout(databases=["default"])
    assert "span 1000" in other.msg
    settings.AGENTRUNS = {}
    [off] = check_history_layout(databases=["default"])
    assert "HISTORY_PARTITION is None" in off.msg


def test_the_layout_check_is_quiet_by_default() -> None:
    assert check_history_layout(databases=["default"]) == []
