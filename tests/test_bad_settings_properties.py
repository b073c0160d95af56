"""Bad settings, generated (guarantee 10): whatever AGENTRUNS holds, the system checks report
it with stable ids and never crash, and a number the check accepts is one the library can
use. The strategies are shared with tests/test_bad_input_properties.py.
"""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.test import override_settings
from django.utils import timezone as django_tz
from hypothesis import assume, example, given
from hypothesis import strategies as st

from django_agentruns import checks as agentruns_checks
from django_agentruns.conf import AppSettings, Defaults
from django_agentruns.registry import is_queue_name
from tests.test_bad_input_properties import CHECK_IDS, PROPERTY, Opaque, odd_text

# --------------------------------------------------------------------------- settings

CAPS = {"MAX_INPUT_BYTES", "MAX_OUTPUT_BYTES", "MAX_STATE_BYTES", "MAX_EVENT_BYTES",
        "MAX_EVENTS_PER_RUN", "SCHEDULE_MAX_CATCH_UP", "MAX_STEPS_PER_RUN", "MAX_SPAWN_DEPTH",
        "MAX_CHILDREN_PER_RUN", "MAX_DELIVERIES_PER_RUN", "CHECKPOINT_HISTORY"}
NONE_ALLOWED = {"CHECKPOINT_HISTORY"}  # None: no cap
NUMBERS = {"LEASE_TTL", "POLL_INTERVAL", "BACKOFF_BASE", "BACKOFF_CAP", "REAP_INTERVAL",
           "GRACE", "MAX_REQUEUES", "CLAIM_BATCH", "BACKOFF_JITTER", "STREAMS_PER_USER",
           "STREAMS_PER_PROCESS", "WRITER_CONNECTIONS", "MAX_SNOOZES", "WAITERS_PER_PROCESS",
           *CAPS}
AT_LEAST_ONE = ("CLAIM_BATCH", "STREAMS_PER_USER", "STREAMS_PER_PROCESS", "WRITER_CONNECTIONS",
                "WAITERS_PER_PROCESS")
odd_numbers = st.integers() | st.floats() | st.just(10**400) | st.just(-(10**400)) | \
    st.just(float("nan")) | st.just(float("inf")) | st.just(1e308) | st.booleans()
setting_values = odd_numbers | st.none() | odd_text | st.lists(st.integers(), max_size=2) | \
    st.builds(Opaque) | st.just(Decimal("2.5")) | st.just("60")
unknown_keys = st.text(min_size=1, max_size=12).filter(lambda k: k not in AppSettings.known())\
    | st.integers() | st.tuples(st.integers())
classifiers = st.sampled_from([None, "django_agentruns.rules.policy.http_status",
                               "django_agentruns.conf.SETTING_NAME", "no_such_module.f",
                               "django_agentruns.no_such_function", "classify", "", "a..b"]) \
    | setting_values


def check_messages(value: Any) -> list[Any]:
    with override_settings(AGENTRUNS=value):
        return agentruns_checks.check_settings()


def assert_well_formed(messages: list[Any]) -> None:
    for message in messages:
        assert message.id in CHECK_IDS, message
        assert message.msg, message
        assert message.hint, message


@PROPERTY
@given(value=st.dictionaries(st.sampled_from(sorted(AppSettings.known())), setting_values)
       | st.dictionaries(unknown_keys, setting_values, max_size=3)
       | st.dictionaries(st.sampled_from(sorted(AppSettings.known())) | unknown_keys,
                         setting_values, max_size=6))
@example(value={"LEASE_TTL": 10**400})
@example(value={"MAX_REQUEUES": 10**400})
@example(value={1: "a", "TYPO": 2})
@example(value={"BACKOFF_BASE": 10**400, "BACKOFF_CAP": 1})
def test_the_settings_check_reports_any_value_without_crashing(value: dict[Any, Any]) -> None:
    messages = check_messages(value)
    assert_well_formed(messages)
    ids = [m.id for m in messages]
    # Each unknown key is named by an E002 of its own.
    for key in set(value) - AppSettings.known():
        assert any(m.id == agentruns_checks.E002_UNKNOWN_SETTING and repr(key) in m.msg
                   for m in messages), (key, messages)
    # A known key's value is judged by that key alone: reported or not, the same as when
    # it stands alone (apart from the rules that relate two settings: E006, W003).
    for key in set(value) & NUMBERS:
        alone = {m.id for m in check_messages({key: value[key]})} - {
            agentruns_checks.E006_BACKOFF_ORDER, agentruns_checks.W003_SHORT_LEASE}
        if agentruns_checks.E003_BAD_NUMBER in alone:
            assert any(m.id == agentruns_checks.E003_BAD_NUMBER and repr(key) in m.msg
                       for m in messages), (key, messages)
    assert ids.count(agentruns_checks.E001_NOT_A_DICT) == 0


@PROPERTY
@given(value=setting_values | st.lists(setting_values, max_size=3) | st.tuples(st.integers())
       | st.sets(st.integers(), max_size=2))
def test_an_agentruns_setting_that_is_not_a_dict_is_e001(value: Any) -> None:
    assume(value is not None and not isinstance(value, dict))
    messages = check_messages(value)
    assert [m.id for m in messages] == [agentruns_checks.E001_NOT_A_DICT]
    assert_well_formed(messages)


def good_number(key: str) -> st.SearchStrategy[Any]:
    """Values each numeric setting accepts (docs/settings.md's table): sensible magnitudes."""
    if key in AT_LEAST_ONE:
        return st.integers(min_value=1, max_value=1000)
    if key in CAPS:
        return st.integers(min_value=1, max_value=agentruns_checks.LARGEST_SIZE)
    if key in ("MAX_REQUEUES", "MAX_SNOOZES"):
        return st.integers(min_value=0, max_value=1000)
    if key == "BACKOFF_JITTER":
        return st.floats(min_value=0, max_value=1)
    if key in ("LEASE_TTL", "POLL_INTERVAL"):
        return st.floats(min_value=0.001, max_value=86_400) | \
            st.integers(min_value=1, max_value=86_400)
    return st.floats(min_value=0, max_value=86_400) | st.integers(min_value=0, max_value=86_400)


def bad_number(key: str) -> st.SearchStrategy[Any]:
    """Values no numeric setting may hold: not numbers, not finite, out of range."""
    wrong_type = st.booleans() | odd_text | st.just(Decimal("1")) | \
        st.lists(st.integers(), max_size=1) | st.just(10**400)
    if key not in NONE_ALLOWED:
        wrong_type |= st.none()
    not_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
    if key in AT_LEAST_ONE:
        out = st.integers(max_value=0) | st.floats(min_value=1.5, max_value=10, exclude_max=True)
    elif key in CAPS:
        most = agentruns_checks.LARGEST_SIZE if key.endswith("_BYTES") else 2**31 - 1
        out = st.integers(max_value=0) | st.integers(min_value=most + 1) | st.just(1024.0)
    elif key in ("MAX_REQUEUES", "MAX_SNOOZES"):
        out = st.integers(max_value=-1) | st.just(2.5)
    elif key == "BACKOFF_JITTER":
        out = st.floats(min_value=1, exclude_min=True, allow_infinity=False) | \
            st.floats(max_value=0, exclude_max=True, allow_infinity=False)
    elif key in ("LEASE_TTL", "POLL_INTERVAL"):
        out = st.floats(max_value=0, allow_infinity=False) | st.integers(max_value=0)
    else:
        out = st.floats(max_value=0, exclude_max=True, allow_infinity=False) | \
            st.integers(max_value=-1)
    return wrong_type | not_finite | out


@PROPERTY
@given(data=st.data(), keys=st.sets(st.sampled_from(sorted(NUMBERS)), min_size=1))
def test_bad_numbers_get_e003_and_good_ones_nothing(data: st.DataObject,
                                                    keys: set[str]) -> None:
    value: dict[str, Any] = {}
    bad: set[str] = set()
    for key in sorted(keys):
        if data.draw(st.booleans(), label=f"{key} bad"):
            value[key] = data.draw(bad_number(key), label=key)
            bad.add(key)
        else:
            value[key] = data.draw(good_number(key), label=key)
    messages = check_messages(value)
    assert_well_formed(messages)
    flagged = {key for key in NUMBERS for m in messages
               if m.id == agentruns_checks.E003_BAD_NUMBER and repr(key) in m.msg}
    assert flagged == bad, messages
    base = value.get("BACKOFF_BASE", Defaults.BACKOFF_BASE)
    cap = value.get("BACKOFF_CAP", Defaults.BACKOFF_CAP)
    backoff_disorder = not ({"BACKOFF_BASE", "BACKOFF_CAP"} & bad) and cap < base
    others = {m.id for m in messages} - {agentruns_checks.E003_BAD_NUMBER,
                                         agentruns_checks.W003_SHORT_LEASE}
    assert others == ({agentruns_checks.E006_BACKOFF_ORDER} if backoff_disorder else set())


@PROPERTY
@given(classifier=classifiers, queue=st.sampled_from(["default", "", "q" * 101]) | setting_values,
       token=st.none() | odd_text | st.text(min_size=16, max_size=40) | setting_values)
def test_classifier_queue_and_token_are_reported_never_raised(classifier: Any, queue: Any,
                                                              token: Any) -> None:
    messages = check_messages({"CLASSIFIER": classifier, "DEFAULT_QUEUE": queue,
                               "METRICS_TOKEN": token})
    assert_well_formed(messages)
    good_queue = is_queue_name(queue)
    assert (agentruns_checks.E005_BAD_QUEUE in {m.id for m in messages}) is not good_queue
    if isinstance(token, str) and len(token) >= 16:
        assert agentruns_checks.E007_BAD_METRICS_TOKEN not in {m.id for m in messages}
    if token is not None and isinstance(token, str):
        # The token's own message; another setting's value may hold the same text.
        assert all(token not in m.msg for m in messages
                   if len(token) >= 4 and m.id == agentruns_checks.E007_BAD_METRICS_TOKEN), \
            "a secret leaked into a check message"
    if classifier is None or classifier == "django_agentruns.rules.policy.http_status":
        assert agentruns_checks.E004_BAD_CLASSIFIER not in {m.id for m in messages}


DURATIONS = NUMBERS - {"MAX_REQUEUES", "MAX_SNOOZES", "BACKOFF_JITTER", *AT_LEAST_ONE, *CAPS}


@PROPERTY
@given(key=st.sampled_from(sorted(NUMBERS)),
       value=odd_numbers | st.floats(min_value=1e5, max_value=1e300)
       | st.integers(min_value=2**20, max_value=2**80))
@example(key="LEASE_TTL", value=1e12)  # a lease that would end after the year 9999
@example(key="POLL_INTERVAL", value=1e10)  # longer than a thread may wait
@example(key="BACKOFF_CAP", value=10**15)
@example(key="MAX_REQUEUES", value=2**31)  # does not fit the column
def test_a_number_the_check_accepts_is_one_the_library_can_use(key: str, value: Any) -> None:
    if agentruns_checks.E003_BAD_NUMBER in {m.id for m in check_messages({key: value})}:
        return
    if key in DURATIONS:
        # Lease ends, backoff due times and deadlines are now + the setting; workers wait
        # on threading events for up to POLL_INTERVAL.
        django_tz.now() + timedelta(seconds=value)
        assert value <= threading.TIMEOUT_MAX
    elif key == "MAX_REQUEUES":
        assert value <= 2**31 - 1, "AgentRun.max_requeues is an integer column"
    elif key == "MAX_SNOOZES":
        assert value <= 2**31 - 1, "compared with AgentRun.snooze_count, an integer column"
    elif key == "MAX_EVENTS_PER_RUN":
        assert value <= 2**31 - 1, "RunEvent.seq is an integer column"
    elif key in ("SCHEDULE_MAX_CATCH_UP", "MAX_STEPS_PER_RUN", "MAX_SPAWN_DEPTH",
                 "MAX_CHILDREN_PER_RUN", "MAX_DELIVERIES_PER_RUN"):
        # Counts compared with integer columns (a step's occurrence, a run's depth, ...).
        assert value <= 2**31 - 1
    elif key in CAPS:
        assert value <= 64 * 1024 * 1024, "under PostgreSQL's 255 MB for one jsonb value"


def test_property_strategies_reach_every_number_rule() -> None:
    """The numeric keys here are the ones the check knows: a new one must be added."""
    assert {k for k in AppSettings.known()
            if isinstance(getattr(Defaults, k), int | float)
            and not isinstance(getattr(Defaults, k), bool)} == NUMBERS
    assert math.isfinite(Defaults.LEASE_TTL)
