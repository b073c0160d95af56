"""The `@agent` registry: sync and async agents, refused names and options, autodiscovery."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_agentruns import InvalidInputError, RunContext, UnknownAgentError, agent
from django_agentruns.outcomes import ScopePolicy
from django_agentruns.registry import (
    AgentSpec,
    all_agents,
    find_agent,
    get_agent,
    scope_policy,
    unregister,
)
from tests import helpers

NAME = "tests.registry_probe"


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    """Whatever a test registers is gone afterwards; the testapp agents are untouched."""
    before = all_agents()
    yield
    for name in set(all_agents()) - set(before):
        unregister(name)
    assert all_agents() == before


def test_sync_agent_is_registered_with_its_options() -> None:
    def classify(exc: BaseException) -> bool | None:
        return None

    @agent(NAME, queue="mail", ordered=True, dead_letters_block=True, max_requeues=5,
           timeout=12.5, lease_ttl=30, priority=-2, classify=classify)
    def probe(ctx: RunContext) -> dict[str, Any]:
        return {"ok": True}

    spec = get_agent(NAME)
    assert spec == AgentSpec(name=NAME, func=probe, queue="mail", ordered=True,
                             dead_letters_block=True, max_requeues=5, timeout=12.5,
                             lease_ttl=30, priority=-2, classify=classify)
    assert spec.is_async is False
    assert spec.effective_queue() == "mail"
    assert spec.effective_max_requeues() == 5
    assert spec.effective_lease_ttl() == 30.0
    # The decorator hands the function back unchanged: it stays callable directly.
    assert probe.__name__ == "probe"
    assert find_agent(NAME) is spec


def test_async_agent_is_registered_as_async() -> None:
    @agent(NAME)
    async def probe(ctx: RunContext) -> None:
        return None

    spec = get_agent(NAME)
    assert spec.is_async is True
    assert spec.func is probe


def test_options_left_out_follow_the_settings(settings: Any) -> None:
    @agent(NAME)
    def probe(ctx: RunContext) -> None:
        return None

    settings.AGENTRUNS = {**settings.AGENTRUNS, "DEFAULT_QUEUE": "elsewhere",
                          "MAX_REQUEUES": 11, "LEASE_TTL": 42.0}
    spec = get_agent(NAME)
    assert (spec.queue, spec.max_requeues, spec.lease_ttl) == (None, None, None)
    # Read when used, not when registered: a settings change takes effect at once.
    assert spec.effective_queue() == "elsewhere"
    assert spec.effective_max_requeues() == 11
    assert spec.effective_lease_ttl() == 42.0


@pytest.mark.parametrize(
    "name",
    ["", "has space", "slash/name", "x" * 201, "tab\tname", "é", 5, None, b"tests.bytes",
     "tests.newline\n"],
    ids=["empty", "space", "slash", "too-long", "tab", "non-ascii", "int", "none", "bytes",
         "trailing-newline"],
)
def test_bad_names_are_refused(name: Any) -> None:
    with pytest.raises(InvalidInputError, match="name"):
        agent(name)
    assert len(all_agents()) == len(set(all_agents()))  # nothing half-registered


def test_longest_allowed_name_is_accepted() -> None:
    name = "tests." + "x" * 194

    @agent(name)
    def probe(ctx: RunContext) -> None:
        return None

    assert get_agent(name).func is probe


BAD_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("max_requeues-negative", {"max_requeues": -1}),
    ("max_requeues-bool", {"max_requeues": True}),
    ("max_requeues-float", {"max_requeues": 1.5}),
    ("max_requeues-str", {"max_requeues": "3"}),
    ("timeout-negative", {"timeout": -1}),
    ("timeout-str", {"timeout": "10"}),
    ("timeout-nan", {"timeout": float("nan")}),
    ("timeout-bool", {"timeout": True}),
    ("lease_ttl-zero", {"lease_ttl": 0}),
    ("lease_ttl-negative", {"lease_ttl": -5}),
    ("lease_ttl-str", {"lease_ttl": "60"}),
    ("lease_ttl-inf", {"lease_ttl": float("inf")}),
    ("priority-str", {"priority": "high"}),
    ("priority-float", {"priority": 1.5}),
    ("priority-bool", {"priority": True}),
    ("priority-too-big", {"priority": 40000}),
    ("queue-empty", {"queue": ""}),
    ("queue-int", {"queue": 5}),
    ("queue-too-long", {"queue": "q" * 101}),
    ("classify-not-callable", {"classify": "mymodule.classify"}),
]


@pytest.mark.parametrize("options", [o for _, o in BAD_OPTIONS],
                         ids=[name for name, _ in BAD_OPTIONS])
def test_bad_options_are_refused(options: dict[str, Any]) -> None:
    (option,) = options
    with pytest.raises(InvalidInputError, match=option):
        agent(NAME, **options)
    assert find_agent(NAME) is None


def test_zero_requeues_and_no_timeout_are_valid() -> None:
    @agent(NAME, max_requeues=0, timeout=None)
    def probe(ctx: RunContext) -> None:
        return None

    assert get_agent(NAME).effective_max_requeues() == 0


def test_a_name_taken_by_another_function_is_refused() -> None:
    @agent(NAME)
    def first(ctx: RunContext) -> str:
        return "first"

    def second(ctx: RunContext) -> str:
        return "second"

    with pytest.raises(InvalidInputError, match=r"already registered.*first"):
        agent(NAME)(second)
    assert get_agent(NAME).func is first


def test_a_testapp_name_cannot_be_hijacked() -> None:
    def impostor(ctx: RunContext) -> None:
        return None

    original = get_agent("tests.once").func
    with pytest.raises(InvalidInputError, match=r"tests\.once"):
        agent("tests.once")(impostor)
    assert get_agent("tests.once").func is original


def test_registering_the_same_function_again_is_allowed() -> None:
    """A module imported twice (autoreload, a test importing it) registers again: no error."""

    def make() -> Callable[[RunContext], None]:
        def probe(ctx: RunContext) -> None:
            return None

        return probe

    first, again = make(), make()  # distinct objects, one qualified name
    agent(NAME, priority=1)(first)
    agent(NAME, priority=2)(again)
    assert get_agent(NAME).func is again
    assert get_agent(NAME).priority == 2


def test_scope_policy_is_read_from_the_registry() -> None:
    """Only ordered agents keep firing order; dead_letters_block means nothing without it."""
    def probe(ctx: RunContext) -> None:
        return None

    agent(NAME, ordered=True, dead_letters_block=True)(probe)
    agent(f"{NAME}.unordered", dead_letters_block=True)(probe)
    scopes = scope_policy()
    assert NAME in scopes.ordered
    assert NAME in scopes.dead_letters_block
    assert f"{NAME}.unordered" not in scopes.ordered | scopes.dead_letters_block
    assert scope_policy({NAME: get_agent(NAME)}) == ScopePolicy(frozenset({NAME}),
                                                                frozenset({NAME}))
    assert scope_policy({}) == ScopePolicy()


def test_unknown_name_lookup() -> None:
    with pytest.raises(UnknownAgentError, match=r"tests\.nope.*tests\.noop"):
        get_agent("tests.nope")
    assert find_agent("tests.nope") is None


def test_testapp_agents_are_registered_with_their_options() -> None:
    agents = all_agents()
    assert agents["tests.async_steps"].is_async
    assert not agents["tests.once"].is_async
    assert agents["tests.ordered"].ordered
    assert agents["tests.ordered_blocking"].dead_letters_block
    assert agents["tests.always_fails"].max_requeues == 2
    assert agents["tests.sleeper"].lease_ttl == 1.0
    assert all(spec.func.__module__.startswith("tests.testapp.")
               for name, spec in agents.items() if name.startswith("tests."))


def test_autodiscovery_registers_the_testapp_agents_at_setup() -> None:
    """In a fresh interpreter, `django.setup()` alone imports every app's agents module."""
    code = (
        "import json, sys, django\n"
        "from django_agentruns.registry import all_agents\n"
        "assert not all_agents(), 'registered before setup'\n"
        "assert 'tests.testapp.agents' not in sys.modules\n"
        "django.setup()\n"
        "print(json.dumps({n: [s.func.__module__, s.is_async] for n, s in "
        "all_agents().items()}))\n"
    )
    env = helpers.subprocess_env({"ENGINE": "django.db.backends.sqlite3",
                                  "NAME": str(helpers.TMP_DIR / "unused.sqlite3")})
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=helpers.REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    discovered: dict[str, list[Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    # The testapp's agents (agents.py and what it imports), and the app's own task agents.
    assert {module for module, _ in discovered.values()
            if not module.startswith("django_agentruns.")} <= {
        "tests.testapp.agents", "tests.testapp.chaos_agents", "tests.testapp.failure_agents",
        "tests.testapp.waiting_agents", "tests.testapp.writer_agents",
        "tests.testapp.stream_agents", "tests.testapp.flow_agents", "tests.testapp.step_agents",
        "tests.testapp.provider_agents", "tests.testapp.framework_agents"}
    assert "tests.testapp.agents" in {module for module, _ in discovered.values()}
    # Compared on the agents this process knows too (agents.py may grow meanwhile).
    ours = {name: spec.is_async for name, spec in all_agents().items()
            if spec.func.__module__ == "tests.testapp.agents"}
    assert {name: discovered[name][1] for name in ours if name in discovered} == ours
    assert discovered["tests.async_steps"][1] is True
    assert discovered["tests.once"][1] is False
