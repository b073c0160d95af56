"""`READ_DATABASE` on any database: its system check, the named reads that follow it, and
no lag note without a replica. The replica itself: tests/test_read_replica.py."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from django_agentruns import enqueue
from django_agentruns.models import AgentRun, RunEvent
from django_agentruns.ops import replica
from django_agentruns.queries import reading


@pytest.mark.parametrize(("value", "problem"), [
    ("replica", True), (3, True), ("default", False), (None, False)])
def test_the_read_database_must_be_an_alias(value: Any, problem: bool) -> None:
    with override_settings(AGENTRUNS={"READ_DATABASE": value}):
        messages = replica.check_read_database()
    assert [m.id for m in messages] == ([replica.E019_BAD_READ_DATABASE] if problem else [])
    if problem:
        assert repr(value) in messages[0].msg
        assert "default" in (messages[0].hint or "")


def test_named_reads_use_the_read_database(settings: Any) -> None:
    assert AgentRun.objects.for_reading().db == "default"
    settings.AGENTRUNS = {**settings.AGENTRUNS, "READ_DATABASE": "elsewhere"}
    assert AgentRun.objects.for_reading().db == "elsewhere"
    assert reading(RunEvent.objects.all()).db == "elsewhere"
    assert AgentRun.objects.all().db == "default"  # everything else: the primary


def test_no_replica_no_lag(db: None) -> None:
    enqueue("tests.noop")
    assert replica.lag() is None
    assert replica.lag_note() is None
