"""Who may watch a run's event stream (and its live output), run by run.

The global `view_agentrun` shows every run; an object permission (a backend such as
django-guardian, here a tiny one), the `STREAM_ACCESS` rule or a signed, expiring link
(`stream_url`) shows one run. Everyone else gets the same 403 whether the run exists or
not, so the answer does not tell which ids exist.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth.models import User
from django.http import HttpRequest
from django.test import Client, override_settings

from django_agentruns import InvalidInputError, checks, stream_url
from django_agentruns.models import AgentRun
from django_agentruns.streaming import signing
from tests import helpers
from tests.test_stream import (
    finished_run,
    make_user,
    parse,
    streams_let_go,  # noqa: F401  (autouse here too)
    trail,
    url,
)

VIEW = "django_agentruns.view_agentrun"
MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"


class OwnRunsBackend:
    """An object-permission backend: a user may view the runs whose input names them."""

    def authenticate(self, request: HttpRequest | None, **credentials: Any) -> None:
        return None

    def has_perm(self, user: User, perm: str, obj: Any = None) -> bool:
        return perm == VIEW and isinstance(obj, AgentRun) and owns(user, obj)


def owns(user: Any, run: AgentRun) -> bool:
    return bool(user.is_authenticated) and run.input.get("owner") == user.username


def owner_rule(request: HttpRequest, run: AgentRun) -> bool:
    """A STREAM_ACCESS rule: the same, as the app's own callable."""
    return owns(request.user, run)


def owned_run(owner: str) -> AgentRun:
    run = finished_run(steps=1)
    helpers.store_payloads([run.pk], "input", {"owner": owner})
    return run


def alice_run() -> AgentRun:
    return next(r for r in AgentRun.objects.all() if r.input.get("owner") == "alice")


def watch(client: Client, path: str) -> tuple[int, str]:
    """Status and body (a stream read to its end: the runs here are finished)."""
    response = client.get(path)
    if response.status_code != 200:
        return response.status_code, response.content.decode()
    return 200, b"".join(response.streaming_content).decode()


def event_seqs(body: str) -> list[int]:
    return [m.json["seq"] for m in parse(body) if m.event == "message" and m.data]


def assert_one_run_only(client: Client) -> None:
    """Alice sees her run, not Bob's, and Bob's run and a missing one look the same."""
    alice, bob = owned_run("alice"), owned_run("bob")
    client.force_login(User.objects.get(username="alice"))
    status, body = watch(client, url(alice.pk))
    assert status == 200
    assert event_seqs(body) == [seq for seq, _, _ in trail(alice)]
    assert parse(body)[-1].event == "end"
    other, missing = watch(client, url(bob.pk)), watch(client, url(bob.pk + 1000))
    assert other[0] == 403
    assert other == missing  # the same answer: no id is revealed


@pytest.fixture
def users(db: None) -> None:
    make_user("alice")
    make_user("bob")


@pytest.mark.usefixtures("users")
def test_an_object_permission_lets_a_user_watch_that_run_only(client: Client) -> None:
    with override_settings(AUTHENTICATION_BACKENDS=[
            MODEL_BACKEND, f"{__name__}.OwnRunsBackend"]):
        assert_one_run_only(client)


@pytest.mark.usefixtures("users")
def test_the_stream_access_rule_lets_a_user_watch_that_run_only(client: Client) -> None:
    with override_settings(AGENTRUNS={"STREAM_ACCESS": f"{__name__}.owner_rule"}):
        assert_one_run_only(client)
    client.force_login(User.objects.get(username="alice"))
    assert watch(client, url(alice_run().pk))[0] == 403


def test_without_permission_a_missing_run_is_refused_as_an_existing_one(
        client: Client, db: None) -> None:
    run = finished_run(steps=1)
    client.force_login(make_user("nobody"))
    assert watch(client, url(run.pk)) == watch(client, url(run.pk + 1000))
    assert watch(client, url(run.pk))[0] == 403
    client.logout()
    assert watch(client, url(run.pk)) == watch(client, url(run.pk + 1000))


def test_a_signed_link_lets_anyone_watch_that_run_until_it_expires(
        client: Client, db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    run, other = finished_run(steps=1), finished_run(steps=1)
    link = stream_url(run.pk)
    assert link.startswith(url(run.pk) + "?")
    status, body = watch(client, link)  # anonymous, no permission
    assert status == 200
    assert event_seqs(body) == [seq for seq, _, _ in trail(run)]
    # A reconnect (EventSource keeps the link) resumes after its position.
    assert event_seqs(watch(client, f"{link}&after=1")[1]) == \
        [seq for seq, _, _ in trail(run)][1:]

    query = parse_qs(urlsplit(link).query)
    expires, signature = query["expires"][0], query["signature"][0]
    tampered = f"{url(run.pk)}?expires={expires}&signature={signature[:-2]}xx"
    stretched = f"{url(run.pk)}?expires={int(expires) + 3600}&signature={signature}"
    elsewhere = f"{url(other.pk)}?expires={expires}&signature={signature}"
    missing = f"{url(run.pk + 1000)}?expires={expires}&signature={signature}"
    for bad in (tampered, stretched, elsewhere, missing, f"{url(run.pk)}?signature=x"):
        assert watch(client, bad) == (403, signing_refusal("not valid")), bad

    # A link made for a run that is gone: the maker knew the id.
    assert watch(client, stream_url(run.pk + 1000))[0] == 404
    later = float(expires) + 1
    monkeypatch.setattr(signing.time, "time", lambda: later)
    assert watch(client, link) == (403, signing_refusal("expired"))


def signing_refusal(why: str) -> str:
    from django_agentruns.streaming import access

    return (access.EXPIRED if why == "expired" else access.INVALID) + "\n"


def test_a_signature_does_not_outlive_the_secret_key(client: Client, db: None) -> None:
    run = finished_run(steps=1)
    link = stream_url(run.pk, expires=60)
    with override_settings(SECRET_KEY="another secret key, of fifty characters or more!!"):
        assert watch(client, link)[0] == 403


@pytest.mark.parametrize("expires", [0, -5, float("nan"), float("inf"), True, "60",
                                     400 * 24 * 3600])
def test_stream_url_refuses_a_bad_lifetime(expires: Any) -> None:
    with pytest.raises(InvalidInputError, match="expires"):
        stream_url(1, expires=expires)


@pytest.mark.parametrize("value", ["tests.test_stream_access.nothing_here", 42,
                                   "tests.test_stream_access.VIEW"])
def test_a_bad_stream_access_setting_is_a_system_check_error(value: Any) -> None:
    with override_settings(AGENTRUNS={"STREAM_ACCESS": value}):
        assert [m.id for m in checks.check_settings()] == [checks.E015_BAD_STREAM_ACCESS]
    with override_settings(AGENTRUNS={"STREAM_ACCESS": f"{__name__}.owner_rule"}):
        assert checks.check_settings() == []
