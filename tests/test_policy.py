"""The pure retry policy: classification, backoff and the next-step decision. No database."""

from __future__ import annotations

from datetime import timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from django_agentruns.exceptions import InvalidInputError, NotRetryable, Retryable
from django_agentruns.rules import policy
from django_agentruns.rules.policy import Decision, Failure

# --------------------------------------------------------------------------- fakes


class Response:
    """The shape of an HTTP client's response object (requests, httpx)."""

    def __init__(self, status_code: int, headers: dict[str, str] | None = None) -> None:
        self.status_code = status_code
        self.headers = headers or {}


class HTTPError(Exception):
    """An HTTP client's error carrying its response, like `requests.HTTPError`."""

    def __init__(self, status_code: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status_code}")
        self.response = Response(status_code, headers)


class APIStatusError(Exception):
    """An SDK error with the status on the exception itself, like `openai.APIStatusError`."""

    def __init__(self, status_code: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"status {status_code}")
        self.status_code = status_code
        self.headers = headers or {}


class FallbackChainExhausted(Exception):
    """A wrapper around every attempt of a fallback chain, most recent last."""

    def __init__(self, attempts: list[BaseException]) -> None:
        super().__init__(f"{len(attempts)} attempts failed")
        self.attempts = attempts


class Mystery(Exception):
    """Nothing in the policy recognises this."""


# --------------------------------------------------------------------------- classify


def test_our_own_markers() -> None:
    assert policy.classify(Retryable("later")) == Failure(retryable=True)
    assert policy.classify(NotRetryable("never")) == Failure(retryable=False)


def test_retryable_carries_its_delay() -> None:
    assert policy.classify(Retryable("later", delay=7.5)) == Failure(retryable=True, delay=7.5)


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502, 503, 504, 599])
@pytest.mark.parametrize("error_class", [HTTPError, APIStatusError])
def test_transient_http_statuses_are_retryable(error_class: type[Exception], status: int) -> None:
    assert policy.classify(error_class(status)).retryable is True


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 410, 422])
@pytest.mark.parametrize("error_class", [HTTPError, APIStatusError])
def test_client_http_statuses_are_not_retryable(error_class: type[Exception], status: int) -> None:
    assert policy.classify(error_class(status)) == Failure(retryable=False)


def test_http_status_wins_over_the_class_name() -> None:
    """A `...Timeout` class carrying a 401 is an auth failure, not a timeout."""

    class GatewayTimeout(Exception):
        status_code = 401

    assert policy.classify(GatewayTimeout()).retryable is False


@pytest.mark.parametrize("header", ["Retry-After", "retry-after"])
def test_retry_after_seconds_is_the_delay(header: str) -> None:
    """A 429 or 503 with a Retry-After snoozes (no budget spent); a 429 closes the key."""
    assert policy.classify(HTTPError(429, {header: "12"})) == Failure(
        retryable=True, delay=12.0, snooze=True, closes_key=True, cause="HTTP 429 Retry-After")
    assert policy.classify(APIStatusError(503, {header: "0.5"})) == Failure(
        True, 0.5, snooze=True, cause="HTTP 503 Retry-After")


def test_retry_after_on_another_transient_status_is_a_retry_not_a_snooze() -> None:
    assert policy.classify(HTTPError(502, {"Retry-After": "3"})) == Failure(True, 3.0)
    assert policy.classify(HTTPError(429)) == Failure(True, None)  # no header: a retry


def test_retry_after_http_date_is_the_delay() -> None:
    when = timezone.now() + timedelta(seconds=120)
    failure = policy.classify(HTTPError(503, {"Retry-After": format_datetime(when, usegmt=True)}))
    assert failure.retryable is True
    assert failure.delay is not None
    # The header has whole seconds; a little time passes while classifying.
    assert 115 <= failure.delay <= 120


def test_retry_after_in_the_past_is_no_wait() -> None:
    when = timezone.now() - timedelta(hours=1)
    failure = policy.classify(HTTPError(429, {"Retry-After": format_datetime(when, usegmt=True)}))
    assert (failure.retryable, failure.delay, failure.snooze) == (True, 0.0, True)


def test_negative_or_garbage_retry_after() -> None:
    assert policy.classify(HTTPError(429, {"Retry-After": "-5"})).delay == 0.0
    assert policy.classify(HTTPError(429, {"Retry-After": "soon"})) == Failure(True, None)


def test_retry_after_is_ignored_on_a_permanent_failure() -> None:
    assert policy.classify(HTTPError(400, {"Retry-After": "30"})) == Failure(False, None)


@pytest.mark.parametrize(
    "exc", [TimeoutError("slow"), ConnectionError("reset"), ConnectionResetError(),
            ConnectionRefusedError(), BrokenPipeError()],
    ids=type,
)
def test_timeouts_and_connection_errors_are_retryable(exc: BaseException) -> None:
    assert policy.classify(exc) == Failure(retryable=True)


@pytest.mark.parametrize("exc", [ImproperlyConfigured("no key"), InvalidInputError("bad"),
                                 PermissionError(13, "Permission denied", "/srv/keys")],
                         ids=type)
def test_configuration_errors_are_not_retryable(exc: BaseException) -> None:
    assert policy.classify(exc) == Failure(retryable=False)


@pytest.mark.parametrize(
    ("name", "retryable"),
    [("AuthenticationError", False), ("PermissionDeniedError", False),
     ("APITimeoutError", True), ("APIConnectionError", True), ("RateLimitError", True),
     ("ServiceUnavailable", True), ("OverloadedError", True)],
)
def test_well_known_sdk_names(name: str, retryable: bool) -> None:
    error_class = type(name, (Exception,), {})
    assert policy.classify(error_class()).retryable is retryable


@pytest.mark.parametrize("unknown_retryable", [True, False])
def test_unknown_errors_follow_the_setting(unknown_retryable: bool) -> None:
    failure = policy.classify(Mystery(), unknown_retryable=unknown_retryable)
    assert failure == Failure(retryable=unknown_retryable)
    assert policy.classify(ValueError("x"), unknown_retryable=unknown_retryable).retryable \
        is unknown_retryable


def test_exception_group_is_classified_by_its_last_error() -> None:
    group = ExceptionGroup("both", [TimeoutError(), NotRetryable("key revoked")])
    assert policy.classify(group).retryable is False
    group = ExceptionGroup("both", [NotRetryable("old"), HTTPError(429, {"Retry-After": "3"})])
    assert policy.classify(group) == Failure(retryable=True, delay=3.0, snooze=True,
                                             closes_key=True, cause="HTTP 429 Retry-After")


def test_nested_exception_groups() -> None:
    inner = ExceptionGroup("inner", [ValueError(), HTTPError(401)])
    assert policy.classify(ExceptionGroup("outer", [TimeoutError(), inner])).retryable is False


def test_fallback_chain_is_classified_by_its_most_recent_attempt() -> None:
    chain = FallbackChainExhausted([HTTPError(401), HTTPError(503, {"Retry-After": "4"})])
    assert policy.classify(chain, unknown_retryable=False) == Failure(
        True, 4.0, snooze=True, cause="HTTP 503 Retry-After")
    chain = FallbackChainExhausted([TimeoutError(), HTTPError(403)])
    assert policy.classify(chain, unknown_retryable=True) == Failure(False)


def test_empty_fallback_chain_is_unknown() -> None:
    assert policy.classify(FallbackChainExhausted([]), unknown_retryable=False) == Failure(False)


def _raise_from(outer: Exception, inner: BaseException) -> BaseException:
    try:
        raise outer from inner
    except Exception as exc:
        return exc


def test_cause_chain_is_followed() -> None:
    assert policy.classify(_raise_from(Mystery("wrapped"), NotRetryable()),
                           unknown_retryable=True).retryable is False
    wrapped = _raise_from(Mystery("outer"), _raise_from(Mystery("middle"), HTTPError(502)))
    assert policy.classify(wrapped, unknown_retryable=False).retryable is True


def _raised_while_handling(handling: BaseException, *, suppress: bool) -> BaseException:
    try:
        try:
            raise handling
        except BaseException:
            if suppress:
                raise Mystery("context suppressed") from None
            raise Mystery("while handling")  # noqa: B904 - the implicit context is the point
    except Mystery as exc:
        return exc


def test_implicit_context_is_followed_unless_suppressed() -> None:
    assert policy.classify(_raised_while_handling(TimeoutError(), suppress=False),
                           unknown_retryable=False).retryable is True
    assert policy.classify(_raised_while_handling(TimeoutError(), suppress=True),
                           unknown_retryable=False).retryable is False


def test_a_wrapper_that_is_recognised_itself_is_not_unwrapped() -> None:
    """The outermost recognised error decides: a NotRetryable wrapping a timeout stays so."""
    assert policy.classify(_raise_from(NotRetryable("give up"), TimeoutError())).retryable \
        is False


def test_cycles_in_the_chain_terminate() -> None:
    a, b = Mystery("a"), Mystery("b")
    a.__cause__, b.__cause__ = b, a
    assert policy.classify(a, unknown_retryable=False) == Failure(retryable=False)


def test_custom_hook_overrides_everything() -> None:
    def hook(exc: BaseException) -> bool | None:
        if isinstance(exc, TimeoutError):
            return False
        if isinstance(exc, Mystery):
            return True
        return None

    assert policy.classify(TimeoutError(), custom=hook).retryable is False
    assert policy.classify(Mystery(), custom=hook, unknown_retryable=False).retryable is True
    # Undecided: the built-in rules go on.
    assert policy.classify(HTTPError(404), custom=hook).retryable is False
    assert policy.classify(NotRetryable(), custom=lambda e: True).retryable is True


def test_custom_hook_keeps_retry_after() -> None:
    failure = policy.classify(HTTPError(400, {"Retry-After": "9"}), custom=lambda e: True)
    assert failure == Failure(retryable=True, delay=9.0)


def test_custom_hook_sees_inner_errors_of_wrappers() -> None:
    seen: list[BaseException] = []

    def hook(exc: BaseException) -> bool | None:
        seen.append(exc)
        return False if isinstance(exc, KeyError) else None

    inner = KeyError("model")
    chain = FallbackChainExhausted([TimeoutError(), inner])
    assert policy.classify(chain, custom=hook, unknown_retryable=True).retryable is False
    assert seen == [chain, inner]


def test_http_status_reads_the_exception_then_its_response() -> None:
    assert policy.http_status(APIStatusError(429)) == 429
    assert policy.http_status(HTTPError(503)) == 503
    assert policy.http_status(Mystery()) is None

    class WithBoolStatus(Exception):
        status = True  # not an HTTP status

    assert policy.http_status(WithBoolStatus()) is None


# --------------------------------------------------------------------------- backoff


def _backoff(n: int, r: float, **kw: Any) -> float:
    args: dict[str, Any] = {"base": 2.0, "cap": 300.0, "jitter": 0.25, **kw}
    return policy.backoff(n, rand=lambda: r, **args)


def test_backoff_worked_numbers() -> None:
    """base 2 s, cap 300 s, jitter 0.25: rand 0 takes nothing off, rand 1 takes a quarter."""
    assert _backoff(0, 0.0) == 2.0
    assert _backoff(0, 1.0) == 1.5
    assert _backoff(1, 0.0) == 4.0
    assert _backoff(1, 1.0) == 3.0
    assert _backoff(2, 0.5) == 8.0 * (1 - 0.125)
    assert _backoff(7, 0.0) == 256.0
    assert _backoff(8, 0.0) == 300.0  # 512 capped
    assert _backoff(8, 1.0) == 225.0
    assert _backoff(10_000, 0.0) == 300.0  # a huge requeue count neither overflows nor hangs


def test_backoff_without_jitter_is_exact() -> None:
    assert _backoff(3, 0.9, jitter=0.0) == 16.0


def test_zero_base_or_cap_means_no_wait() -> None:
    assert _backoff(5, 0.3, base=0.0) == 0.0
    assert _backoff(5, 0.3, cap=0.0) == 0.0


def test_jitter_outside_0_1_is_clamped() -> None:
    assert _backoff(0, 1.0, jitter=5.0) == 0.0
    assert _backoff(0, 1.0, jitter=-1.0) == 2.0


@given(
    n=st.integers(min_value=0, max_value=200),
    base=st.floats(min_value=0.001, max_value=1000),
    cap=st.floats(min_value=0.001, max_value=100_000),
    jitter=st.floats(min_value=0, max_value=1),
    r=st.floats(min_value=0, max_value=1),
)
def test_backoff_bounds(n: int, base: float, cap: float, jitter: float, r: float) -> None:
    ceiling = min(cap, base * 2.0 ** min(n, 62))
    delay = policy.backoff(n, base=base, cap=cap, jitter=jitter, rand=lambda: r)
    assert ceiling * (1 - jitter) - 1e-9 <= delay <= ceiling + 1e-9
    assert delay <= cap + 1e-9


@given(n=st.integers(min_value=0, max_value=60), r=st.floats(min_value=0, max_value=1))
def test_backoff_grows_until_the_cap(n: int, r: float) -> None:
    """With the same random draw, the next retry never waits less than this one."""
    assert _backoff(n + 1, r) >= _backoff(n, r)


# --------------------------------------------------------------------------- decide


def _decide(failure: Failure, *, requeue_count: int = 0, max_requeues: int = 3,
            cancel_requested: bool = False) -> Decision:
    return policy.decide(failure, requeue_count=requeue_count, max_requeues=max_requeues,
                         cancel_requested=cancel_requested,
                         backoff_delay=lambda n: 10.0 * (n + 1))


def test_a_requested_cancel_wins() -> None:
    for failure in (Failure(True), Failure(False), Failure(True, 5.0)):
        assert _decide(failure, cancel_requested=True) == Decision("cancel")
        assert _decide(failure, requeue_count=3, cancel_requested=True) == Decision("cancel")


def test_not_retryable_is_dead_lettered_at_once() -> None:
    assert _decide(Failure(False)) == Decision("dead_letter", reason="not_retryable")


def test_spent_budget_is_dead_lettered() -> None:
    assert _decide(Failure(True), requeue_count=3) == \
        Decision("dead_letter", reason="retries_exhausted")
    assert _decide(Failure(True), requeue_count=0, max_requeues=0) == \
        Decision("dead_letter", reason="retries_exhausted")


def test_retry_uses_the_backoff_for_this_requeue() -> None:
    assert _decide(Failure(True), requeue_count=0) == Decision("retry", delay=10.0)
    assert _decide(Failure(True), requeue_count=2) == Decision("retry", delay=30.0)


def test_retry_after_beats_the_backoff() -> None:
    assert _decide(Failure(True, delay=2.5), requeue_count=2) == Decision("retry", delay=2.5)
    assert _decide(Failure(True, delay=0.0), requeue_count=2) == Decision("retry", delay=0.0)


def test_negative_delay_is_no_wait() -> None:
    assert _decide(Failure(True, delay=-3.0)) == Decision("retry", delay=0.0)


@given(
    requeue_count=st.integers(min_value=0, max_value=20),
    max_requeues=st.integers(min_value=0, max_value=20),
    retryable=st.booleans(),
    cancel_requested=st.booleans(),
)
def test_decide_is_total_and_bounded(
    requeue_count: int, max_requeues: int, retryable: bool, cancel_requested: bool
) -> None:
    decision = _decide(Failure(retryable), requeue_count=requeue_count,
                       max_requeues=max_requeues, cancel_requested=cancel_requested)
    may_retry = retryable and not cancel_requested and requeue_count < max_requeues
    assert (decision.action == "retry") is may_retry
    assert decision.action in ("retry", "cancel", "dead_letter")
    assert (decision.action == "cancel") is cancel_requested
