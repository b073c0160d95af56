"""Flow control as operators see it: `why` and the admin say when a run waits for its key,
the limits are edited in the admin (through `set_limit`), runs show their usage, the
overview totals it per agent and per day, and Prometheus counts tokens and cost."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from django_agentruns import enqueue, set_limit, transitions
from django_agentruns.models import AgentLimit, AgentRun, Status
from django_agentruns.ops import metrics
from django_agentruns.ops.visibility import KEY_CLOSED, KEY_FULL, why_not_started
from django_agentruns.runtime.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


def burst() -> None:
    Worker(burst=True, reap_interval=0, max_contention_wait=10).run(install_signals=False)


def why(run_id: int) -> str:
    out = StringIO()
    call_command("why", str(run_id), stdout=out)
    return out.getvalue()


def test_why_says_a_run_waits_for_its_full_key() -> None:
    set_limit("k", 1)
    enqueue("tests.keyed", {"key": "k"})
    waiting = enqueue("tests.keyed", {"key": "k"})
    transitions.claim_limited("w", ["default"], 5, transitions.ScopePolicy(), {}, 60.0)
    assert [h.code for h in why_not_started(waiting.pk)] == [KEY_FULL]
    assert "waiting for its limit key 'k': 1 of its runs are running, its limit is 1" \
        in why(waiting.pk)
    set_limit("k", 2)
    assert why_not_started(waiting.pk) == []


def test_why_says_a_run_waits_for_its_closed_key() -> None:
    run = enqueue("tests.keyed", {"key": "k"})
    at = transitions.now()
    transitions.close_key("k", at + timedelta(seconds=60), "HTTP 429 Retry-After on run 1")
    (hold,) = why_not_started(run.pk)
    assert hold.code == KEY_CLOSED
    assert "closed until" in hold.message
    assert "HTTP 429" in hold.message
    assert why_not_started(run.pk, at + timedelta(seconds=61)) == []
    assert why_not_started(enqueue("tests.keyed", {"key": "free"}).pk) == []


def staff(*perms: str) -> Client:
    user = User.objects.create_user("op", password="pw", is_staff=True)
    for perm in perms:
        user.user_permissions.add(Permission.objects.get(codename=perm))
    client = Client()
    client.force_login(user)
    return client


def test_limits_are_edited_in_the_admin_through_set_limit() -> None:
    client = staff("view_agentlimit", "add_agentlimit", "change_agentlimit", "view_agentrun")
    add = reverse("admin:django_agentruns_agentlimit_add")
    response = client.post(add, {"key": "openai", "max_running": "3"})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert AgentLimit.objects.get(key="openai").max_running == 3
    bad = client.post(add, {"key": "other", "max_running": "-1"})
    assert bad.status_code == 200  # the form refuses it; nothing written
    assert not AgentLimit.objects.filter(key="other").exists()
    nul = client.post(add, {"key": "a\x00b", "max_running": "2"})
    assert nul.status_code == 200  # refused by the form as set_limit would refuse it
    assert AgentLimit.objects.count() == 1
    enqueue("tests.keyed", {"key": "openai"})
    transitions.close_key("openai", transitions.now() + timedelta(seconds=60), "HTTP 429")
    listing = client.get(reverse("admin:django_agentruns_agentlimit_changelist"))
    html = listing.content.decode()
    assert "openai" in html
    assert "until " in html
    assert "HTTP 429" in html
    change = reverse("admin:django_agentruns_agentlimit_change", args=["openai"])
    assert client.post(change, {"max_running": "5"}).status_code == 302
    assert AgentLimit.objects.get(key="openai").max_running == 5


def test_runs_show_their_usage_and_the_overview_totals_it() -> None:
    spent = enqueue("tests.spender", {"steps": 2})
    enqueue("tests.noop")
    burst()
    assert AgentRun.objects.get(pk=spent.pk).status == Status.SUCCEEDED
    client = staff("view_agentrun")
    listing = client.get(reverse("admin:django_agentruns_agentrun_changelist"))
    assert "800 tokens, 0.02" in listing.content.decode()
    page = client.get(reverse("admin:django_agentruns_agentrun_change", args=[spent.pk]))
    assert "800 tokens, 0.02" in page.content.decode()
    overview = client.get(reverse("admin:django_agentruns_agentrun_overview"))
    by_agent = overview.context["usage_by_agent"]
    assert [(r["agent"], r["tokens"], r["runs"]) for r in by_agent] == [
        ("tests.spender", 800, 1)]
    assert [r["tokens"] for r in overview.context["usage_by_day"]] == [800]
    assert 'id="agentruns-usage-agents"' in overview.content.decode()


@pytest.mark.skipif(metrics.prometheus_client is None, reason="prometheus_client missing")
def test_prometheus_counts_tokens_and_cost_by_agent_and_model() -> None:
    from prometheus_client import REGISTRY

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"agent": "tests.spender",
                                                "model": "gpt-test"}) or 0.0

    tokens, cost = value("agentruns_tokens_total"), value("agentruns_cost_total")
    enqueue("tests.spender", {"steps": 2})
    burst()
    assert value("agentruns_tokens_total") - tokens == 800
    assert value("agentruns_cost_total") - cost == pytest.approx(0.02)

    at = transitions.now()
    transitions.close_key("openai", at + timedelta(seconds=30), "HTTP 429")
    backlog = metrics.read_backlog(at)
    assert backlog.closed_keys == {"openai": 30.0}
    families = {f.name: f for f in metrics.BacklogCollector._families(backlog, set())}
    (closed,) = families["agentruns_limit_closed_seconds"].samples
    assert (closed.labels, closed.value) == ({"key": "openai"}, 30.0)
