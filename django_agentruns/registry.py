"""The `@agent` decorator and the registry of agents it fills.

Agents are registered at import; the app config imports every installed app's
`agents` module, as the admin does with `admin.py`.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .conf import app_settings
from .exceptions import InvalidInputError, UnknownAgentError
from .outcomes import ScopePolicy
from .rules.fairness import FairKey, check_agent_fair_key
from .rules.limits import Budget, LimitKey, check_agent_limit_key, check_budget
from .rules.ticks import Timing, check_timing
from .rules.windows import Estimate, check_estimate
from .validation import is_short_text

F = TypeVar("F", bound=Callable[..., Any])

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")
# One rule for queue names, used by enqueue, @agent, DEFAULT_QUEUE and runworker --queues:
# a name one of them accepts is one a worker can serve (no commas, no spaces to strip).
QUEUE_PATTERN = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")
QUEUE_RULE = "1-100 characters of letters, digits and _ . : -"


WORKER_ID_MAX = 255  # AgentRun.claimed_by


def is_queue_name(value: Any) -> bool:
    return isinstance(value, str) and QUEUE_PATTERN.fullmatch(value) is not None


def check_worker_names(queues: Sequence[str], worker_id: str) -> None:
    """Refuse at a worker's start what would fail every claim it makes: a worker id
    `claimed_by` cannot hold, a queue name no run can have."""
    if not is_short_text(worker_id, WORKER_ID_MAX):
        raise InvalidInputError(f"a worker id is 1-{WORKER_ID_MAX} characters with no NUL, "
                                f"not {worker_id!r:.60}")
    for queue in queues:
        if not is_queue_name(queue):
            raise InvalidInputError(f"a queue name is {QUEUE_RULE}, not {queue!r:.120}")


@dataclass(frozen=True)
class AgentSpec:
    """An agent and its policy. `None` means "use the app setting"."""

    name: str
    func: Callable[..., Any]
    queue: str | None = None
    ordered: bool = False
    dead_letters_block: bool = False
    max_requeues: int | None = None
    timeout: float | None = None
    lease_ttl: float | None = None
    priority: int = 0
    classify: Callable[[BaseException], bool | None] | None = None
    schedule_timing: Timing | None = None  # from schedule= / every= (django_agentruns.schedules)
    catch_up: bool = False
    limit_key: LimitKey = None  # a key, or f(input) -> key; see django_agentruns.rules.limits
    budget: Budget | None = None
    version: int = 1  # runs record it; a worker claims runs of its version or older
    migrate: Callable[[Any, int], Any] | None = None  # (state, from_version) -> state
    estimate: Estimate | None = None  # reserved in its key's token/cost windows at claim
    fair_key: FairKey = None  # its runs' fairness group, or f(input) -> group

    @functools.cached_property
    def is_async(self) -> bool:
        """Read per attempt (twice a run): inspect's answer is kept, `func` never changes."""
        return inspect.iscoroutinefunction(self.func)

    def effective_queue(self) -> str:
        return self.queue or str(app_settings.DEFAULT_QUEUE)

    def effective_max_requeues(self) -> int:
        if self.max_requeues is not None:
            return self.max_requeues
        return int(app_settings.MAX_REQUEUES)

    def effective_lease_ttl(self) -> float:
        return float(self.lease_ttl if self.lease_ttl is not None else app_settings.LEASE_TTL)


_registry: dict[str, AgentSpec] = {}


def agent(
    name: str,
    *,
    queue: str | None = None,
    ordered: bool = False,
    dead_letters_block: bool = False,
    max_requeues: int | None = None,
    timeout: float | None = None,
    lease_ttl: float | None = None,
    priority: int = 0,
    classify: Callable[[BaseException], bool | None] | None = None,
    schedule: str | None = None,
    schedule_tz: str | None = None,
    every: int | None = None,
    catch_up: bool = False,
    limit_key: LimitKey = None,
    budget: dict[str, Any] | None = None,
    version: int = 1,
    migrate: Callable[[Any, int], Any] | None = None,
    estimate: dict[str, Any] | None = None,
    fair_key: FairKey = None,
) -> Callable[[F], F]:
    """Register a function (sync or `async def`) taking a `RunContext` as agent `name`.

    `schedule` (a cron expression, in `schedule_tz` or TIME_ZONE) or `every` (seconds,
    aligned to the epoch): one run per tick, the tick's time in `input["tick"]`; missed
    ticks run only the latest unless `catch_up` (see django_agentruns.schedules).
    `limit_key`: the key whose limit its runs count against (a string, or a callable of
    the input); `budget`: {"tokens": N, "cost": X}, past which an attempt stops and the
    run is dead-lettered `budget_exhausted` (see django_agentruns.rules.limits); `estimate`:
    {"tokens": N, "cost": X} a run reserves in its key's token and cost windows when it
    starts, settled with what it records (default: the key's recent average per run).
    `fair_key`: its runs' fairness group (a string, or a callable of the input), see
    django_agentruns.rules.fairness.
    `version`: runs record the version they started under; a worker whose version is
    lower does not claim them. `migrate(state, from_version) -> state`: how a run of an
    older version resumes on this code (its checkpoint state migrated when claimed);
    without it, older runs wait for a worker with their code (docs/steps.md).
    """
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidInputError(
            f"Agent name {name!r} must be 1-200 characters of letters, digits and _ . : -"
        )
    _check_options(name, queue, max_requeues, timeout, lease_ttl, priority, classify)
    timing = None
    if schedule is not None or every is not None or schedule_tz is not None:
        timing = check_timing(schedule, every, schedule_tz, f"Agent {name!r}")
    if not isinstance(catch_up, bool):
        raise InvalidInputError(f"Agent {name!r}: catch_up must be True or False")
    check_agent_limit_key(name, limit_key)
    check_agent_fair_key(name, fair_key)
    checked_budget = check_budget(budget, f"Agent {name!r}: budget")
    checked_estimate = check_estimate(estimate, f"Agent {name!r}: estimate")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version < 2**31:
        raise InvalidInputError(f"Agent {name!r}: version must be a whole number >= 1, "
                                f"not {version!r}")
    if migrate is not None and not callable(migrate):
        raise InvalidInputError(f"Agent {name!r}: migrate must be a callable "
                                f"f(state, from_version) -> state, not {migrate!r}")

    def register(func: F) -> F:
        existing = _registry.get(name)
        if existing is not None and _qualname(existing.func) != _qualname(func):
            raise InvalidInputError(
                f"Agent {name!r} is already registered by {_qualname(existing.func)}"
            )
        _registry[name] = AgentSpec(
            name=name, func=func, queue=queue, ordered=ordered,
            dead_letters_block=dead_letters_block, max_requeues=max_requeues,
            timeout=timeout, lease_ttl=lease_ttl, priority=priority, classify=classify,
            schedule_timing=timing, catch_up=catch_up,
            limit_key=limit_key, budget=checked_budget, version=version, migrate=migrate,
            estimate=checked_estimate, fair_key=fair_key,
        )
        return func

    return register


def _check_options(
    name: str, queue: Any, max_requeues: Any, timeout: Any, lease_ttl: Any, priority: Any,
    classify: Any,
) -> None:
    """Refuse bad options at registration, not at every enqueue or claim (guarantee 10)."""

    def bad(label: str, rule: str, value: Any) -> InvalidInputError:
        return InvalidInputError(f"Agent {name!r}: {label} must be {rule}, not {value!r}")

    def is_number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value)

    if queue is not None and not is_queue_name(queue):
        raise bad("queue", QUEUE_RULE, queue)
    if max_requeues is not None and (isinstance(max_requeues, bool)
                                     or not isinstance(max_requeues, int) or max_requeues < 0):
        raise bad("max_requeues", "a whole number >= 0", max_requeues)
    if timeout is not None and (not is_number(timeout) or timeout < 0):
        raise bad("timeout", "a number of seconds >= 0", timeout)
    if lease_ttl is not None and (not is_number(lease_ttl) or lease_ttl <= 0):
        raise bad("lease_ttl", "a number of seconds > 0", lease_ttl)
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not -32768 <= priority <= 32767:
        raise bad("priority", "a whole number in -32768..32767", priority)
    if classify is not None and not callable(classify):
        raise bad("classify", "a callable f(exc) -> bool | None", classify)


def _qualname(func: Callable[..., Any]) -> str:
    return f"{func.__module__}.{func.__qualname__}"


def get_agent(name: str) -> AgentSpec:
    try:
        return _registry[name]
    except (KeyError, TypeError):
        raise UnknownAgentError(str(name), list(_registry)) from None


def find_agent(name: str) -> AgentSpec | None:
    return _registry.get(name)


def all_agents() -> dict[str, AgentSpec]:
    return dict(_registry)


def scope_policy(agents: dict[str, AgentSpec] | None = None) -> ScopePolicy:
    """Which agents keep firing order per scope, and which let dead letters block it: what
    the claim and the admin's "blocked" filter need of the registry (all of it by default)."""
    specs = (agents if agents is not None else all_agents()).values()
    return ScopePolicy(
        ordered=frozenset(s.name for s in specs if s.ordered),
        dead_letters_block=frozenset(s.name for s in specs if s.ordered and s.dead_letters_block),
    )


def claimable_version(spec: AgentSpec, run_version: int) -> bool:
    """Whether this code may run a run started under `run_version` of its agent: its own
    version, or an older one it has a `migrate` for; never a newer one."""
    return run_version == spec.version or (run_version < spec.version
                                           and spec.migrate is not None)


def version_rule(agents: frozenset[str]) -> tuple[tuple[str, int, bool], ...]:
    """What the claim needs to know of `agents`' versions: (name, version, migrates) of
    each whose version is not 1 (the usual case leaves this empty)."""
    return tuple(sorted((s.name, s.version, s.migrate is not None)
                        for s in (_registry.get(a) for a in agents)
                        if s is not None and s.version != 1))


def unregister(name: str) -> None:
    """For tests that register agents of their own."""
    _registry.pop(name, None)
