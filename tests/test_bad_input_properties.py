"""Bad input, generated (guarantee 10): whatever a caller passes, `enqueue` either stores
exactly what JSON would keep or raises `InvalidInputError` / `UnknownAgentError`, and a
refused call writes nothing. (Whatever AGENTRUNS holds, the system checks report it with
stable ids and never crash: tests/test_bad_settings_properties.py.)

The examples in test_enqueue.py and test_checks.py name the known cases; these properties
look for the unknown ones, on both engines (a value SQLite stores may be one PostgreSQL
refuses: NUL characters, lone surrogates, deep nesting).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from django_agentruns import (
    CancelResult,
    InvalidInputError,
    RunRequest,
    UnknownAgentError,
    cancel,
    enqueue,
    enqueue_many,
    retry,
    run_now,
)
from django_agentruns import checks as agentruns_checks
from django_agentruns.api import LATEST_RUN_AFTER
from django_agentruns.models import AgentRun, RunEvent
from django_agentruns.registry import is_queue_name
from django_agentruns.validation import unstorable_text

AGENT = "tests.noop"
DOCUMENTED = (InvalidInputError, UnknownAgentError)
CHECK_IDS = {value for value in vars(agentruns_checks).values()
             if isinstance(value, str) and re.fullmatch(r"agentruns\.[EW]\d{3}", value)}

# Each example runs in the test's transaction, rolled back after: no need for a clean slate.
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


class Nested(list[Any]):
    """Lists `depth` deep, with a short repr (hypothesis prints failing examples)."""

    def __init__(self, depth: int) -> None:
        value: list[Any] = []
        for _ in range(depth - 1):
            value = [value]
        super().__init__([value])
        self.depth = depth

    def __repr__(self) -> str:
        return f"Nested({self.depth})"


def nested(depth: int) -> Any:
    return Nested(depth)


class Opaque:
    """Not JSON, and says so in its repr."""

    def __repr__(self) -> str:
        return "<Opaque>"


# Text as callers really send it, odd Unicode included: NUL, lone surrogates, emoji,
# combining marks, right-to-left, private use.
odd_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=30) | \
    st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfff", "\ud83d\ude00", "😀", "é",
                     "\u202e", "\ufeff", "\uffff", "\U0010ffff", "\\u0000", '"', "\\"])
json_leaves = st.none() | st.booleans() | st.integers() | \
    st.floats(allow_nan=True, allow_infinity=True) | odd_text
junk = st.builds(Opaque) | st.builds(object) | st.sets(st.integers(), max_size=3) | \
    st.binary(max_size=10) | st.just(Decimal("1.5")) | st.datetimes() | \
    st.just(float("nan")) | st.just(float("-inf")) | st.complex_numbers(max_magnitude=5)
payloads = st.recursive(
    json_leaves | junk,
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(odd_text | st.integers() | st.floats() | st.booleans() | st.none()
                      | st.tuples(st.integers()), children, max_size=4),
    max_leaves=25,
)


def run_count() -> int:
    return AgentRun.objects.count()


def as_json(value: Any) -> Any:
    """What storing `value` as JSON keeps of it: tuples become lists."""
    return json.loads(json.dumps(value, allow_nan=False))


def has_odd_key(value: Any) -> bool:
    """A dict key that is not a string, anywhere in `value`: JSON would make it one (and
    merge 1 with a "1" beside it), so such a value is refused, never stored altered."""
    if isinstance(value, dict):
        return any(not isinstance(k, str) or has_odd_key(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_odd_key(v) for v in value)
    return False


def same_json(stored: Any, expected: Any) -> bool:
    """Equal as JSON values. A number may come back as another type of the same value:
    PostgreSQL's jsonb keeps numbers as numerics, so 5.6e16 is read back as an int."""
    if isinstance(expected, dict):
        return isinstance(stored, dict) and stored.keys() == expected.keys() and all(
            same_json(stored[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(stored, list) and len(stored) == len(expected) and all(
            same_json(a, b) for a, b in zip(stored, expected, strict=True))
    if isinstance(expected, float) and isinstance(stored, int) \
            and not isinstance(stored, bool):
        return float(stored) == expected
    return type(stored) is type(expected) and stored == expected


def attempt(call: Any) -> tuple[Any, BaseException | None]:
    """Call, in a savepoint of its own (so a database error cannot poison the test's
    transaction and hide what it left behind), and return the result or the exception."""
    try:
        with transaction.atomic():
            return call(), None
    except Exception as exc:
        return None, exc


@pytest.mark.django_db
@PROPERTY
@given(value=payloads)
@example(value={"text": "a\x00b"})
@example(value={"a\x00": 1})
@example(value=["\ud800"])
@example(value={"pair": "\ud83d\ude00"})  # two code points, not one emoji
@example(value=nested(200))
@example(value=nested(5000))
@example(value=nested(200_000))
@example(value={1: "int key", "1": "str key"})
@example(value={"big": 10**100, "small": -(10**100), "tiny": 5e-324})
def test_enqueue_input_is_stored_as_json_keeps_it_or_refused(value: Any) -> None:
    before = run_count()
    run, error = attempt(lambda: enqueue(AGENT, value))
    if error is not None:
        assert isinstance(error, InvalidInputError), f"{type(error).__name__}: {error}"
        assert str(error), "an error without a message"
        assert run_count() == before, "a refused enqueue left a row behind"
        return
    assert not has_odd_key(value), "a non-string key was accepted"
    assert run_count() == before + 1
    stored = AgentRun.objects.get(pk=run.pk).input
    assert same_json(stored, as_json({} if value is None else value)), stored


@pytest.mark.django_db
@pytest.mark.parametrize("size", [1_000_000, 8_000_000])
def test_a_huge_payload_is_stored_whole(size: int) -> None:
    value = {"blob": "x" * size, "items": list(range(size // 100))}
    with override_settings(AGENTRUNS={"MAX_INPUT_BYTES": 2 * size}):
        run = enqueue(AGENT, value)
    assert AgentRun.objects.get(pk=run.pk).input == value


anything = payloads | st.integers(min_value=-(2**70), max_value=2**70) | \
    st.timedeltas() | st.datetimes(timezones=st.none() | st.just(UTC)) | \
    st.just(timedelta.max) | st.just(timedelta.min) | st.just(datetime.max.replace(tzinfo=UTC))
agent_names = st.sampled_from([AGENT, "tests.chaos", "tests.ordered", "no.such.agent", ""]) | \
    anything
scopes = st.sampled_from(["", "ticket-42", "s" * 255, "s" * 256]) | anything
queues = st.sampled_from([None, "default", "other", "", "q" * 100, "q" * 101, "x,y", " q ",
                          "é"]) | anything
priorities = st.none() | st.integers(min_value=-40_000, max_value=40_000) | anything
run_afters = st.none() | st.floats() | st.integers() | st.timedeltas() | \
    st.datetimes(timezones=st.none() | st.just(UTC) | st.just(timezone(timedelta(hours=-12)))) \
    | anything
fired_seqs = st.integers(min_value=-(2**64), max_value=2**64) | anything


@pytest.mark.django_db
@PROPERTY
@given(agent=agent_names, scope=scopes, queue=queues, priority=priorities,
       run_after=run_afters, fired_seq=fired_seqs)
@example(agent=AGENT, scope="\ud800", queue=None, priority=None, run_after=None, fired_seq=0)
@example(agent=AGENT, scope="", queue="q\udfff", priority=None, run_after=None, fired_seq=0)
@example(agent=AGENT, scope="", queue="x,y", priority=None, run_after=None, fired_seq=0)
@example(agent=AGENT, scope="", queue=" q ", priority=None, run_after=None, fired_seq=0)
@example(agent=AGENT, scope="", queue=None, priority=None, run_after=timedelta.max,
         fired_seq=0)
@example(agent=AGENT, scope="", queue=None, priority=None, run_after=timedelta.min,
         fired_seq=0)
@example(agent=AGENT, scope="", queue=None, priority=None,
         run_after=datetime.max.replace(tzinfo=UTC), fired_seq=0)
@example(agent=["unhashable"], scope="", queue=None, priority=None, run_after=None,
         fired_seq=0)
def test_every_argument_of_enqueue_is_checked(
    agent: Any, scope: Any, queue: Any, priority: Any, run_after: Any, fired_seq: Any,
) -> None:
    before = run_count()
    run, error = attempt(lambda: enqueue(agent, {"n": 1}, scope=scope, queue=queue,
                                         priority=priority, run_after=run_after,
                                         fired_seq=fired_seq))
    if error is not None:
        assert isinstance(error, DOCUMENTED), f"{type(error).__name__}: {error}"
        assert run_count() == before, "a refused enqueue left a row behind"
        if isinstance(error, UnknownAgentError):
            assert repr(str(agent)) in str(error)
        return
    stored = AgentRun.objects.get(pk=run.pk)
    assert (stored.agent, stored.scope, stored.fired_seq) == (agent, scope, fired_seq)
    assert stored.queue == (queue if queue is not None else "default")
    assert is_queue_name(stored.queue), "a queue no worker can serve"
    assert stored.available_at < LATEST_RUN_AFTER
    if priority is not None:
        assert stored.priority == priority
    if isinstance(run_after, datetime):
        assert stored.available_at == run_after
    assert not RunEvent.objects.filter(run_id=run.pk).exists()


requests = st.fixed_dictionaries(
    {"agent": st.sampled_from([AGENT, "tests.chaos"]), "input": payloads},
    optional={"scope": scopes, "queue": queues, "priority": priorities,
              "run_after": run_afters, "fired_seq": fired_seqs,
              "surprise": anything},
)


@pytest.mark.django_db
@settings(PROPERTY, max_examples=80)
@given(batch=st.lists(requests, min_size=1, max_size=5), as_objects=st.booleans())
def test_enqueue_many_writes_all_or_nothing(batch: list[dict[str, Any]],
                                            as_objects: bool) -> None:
    before = run_count()
    if as_objects:
        assume(all("surprise" not in r for r in batch))
        given_requests: list[Any] = [RunRequest(**r) for r in batch]
    else:
        given_requests = batch
    runs, error = attempt(lambda: enqueue_many(given_requests))
    if error is not None:
        assert isinstance(error, DOCUMENTED), f"{type(error).__name__}: {error}"
        assert run_count() == before, "part of a refused batch was written"
        return
    assert run_count() == before + len(batch)
    for run, request in zip(runs, batch, strict=True):
        stored = AgentRun.objects.get(pk=run.pk)
        value = request["input"]
        assert not has_odd_key(value), "a non-string key was accepted"
        assert same_json(stored.input, as_json({} if value is None else value)), stored.input


# --------------------------------------------------------------------------- free text

@pytest.mark.django_db
@PROPERTY
@given(message=odd_text)
@example(message="a\x00b")
@example(message="lone \ud800 surrogate")
def test_an_agent_error_with_any_message_is_recorded(message: str) -> None:
    """The error is the agent's to raise, so it is recorded as well as it can be (NUL and
    surrogates escaped), never replaced by a database error that leaves the run running."""
    with pytest.raises(ValueError) as raised:  # noqa: PT011 (any message: it is the input)
        run_now("tests.raises", {"codepoints": [ord(c) for c in message]})
    assert str(raised.value) == message
    assert type(raised.value) is ValueError, "the agent's error, not a storage error"
    run = AgentRun.objects.filter(agent="tests.raises").latest("pk")
    assert (run.status, run.reason, run.error_type) == ("failed", "error", "ValueError")
    assert not unstorable_text(run.error_message)
    if not unstorable_text(message):
        assert run.error_message == message


@pytest.mark.django_db
@PROPERTY
@given(reason=odd_text | anything, by=odd_text | anything)
@example(reason="nul \x00", by="lone \udc80")
def test_cancel_and_retry_take_any_reason_and_operator(reason: Any, by: Any) -> None:
    run = enqueue(AGENT)
    result, error = attempt(lambda: cancel(run.pk, reason=reason))
    assert error is None, f"{type(error).__name__}: {error}"
    assert result is CancelResult.CANCELLED
    retried, error = attempt(lambda: retry(run.pk, by=by))
    assert error is None, f"{type(error).__name__}: {error}"
    assert retried is True
    assert AgentRun.objects.get(pk=run.pk).status == "queued"
