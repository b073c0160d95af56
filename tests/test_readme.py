"""The examples of the README and of every guide in docs/ run as printed.

Each ```python block of README.md and docs/*.md is executed here, in the order printed, the
blocks of one file sharing a namespace (as a reader pastes them one after the other). A
snippet that stops working fails this test, not a new user's first hour. The conventions a
guide's author follows:

- ```python blocks are run; a block opened with ```python skip is shown only (say why
  next to it). Other languages (sh, console, js, yaml) are not run.
- A block whose first line is `# settings.py...` is a settings module: it runs with a copy
  of the test settings' DATABASES and INSTALLED_APPS to edit, and the AGENTRUNS and TASKS
  it defines are in force for the rest of its file.
- A block whose first line is `# myapp/NAME.py...` is module NAME of an installed app:
  later blocks' `from myapp.NAME import ...` import it.
- Names an example takes from the reader's project or from a provider's SDK (`Ticket`,
  `payments`, `openai`, ...) are the stand-ins defined below.
- Agents a file registers are unregistered after it, so files may reuse names.
"""

from __future__ import annotations

import copy
import itertools
import re
import sys
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_agentruns import approve
from django_agentruns.models import AgentRun, StreamChunk
from django_agentruns.registry import all_agents, unregister
from django_agentruns.runtime.worker import Worker
from django_agentruns.tasks import TASKS_AVAILABLE, UNAVAILABLE_REASON, compat
from tests import helpers

DOCUMENTS = [helpers.REPO_ROOT / "README.md",
             *sorted((helpers.REPO_ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python( skip)?[ \t]*\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
SETTINGS_BLOCK = re.compile(r"#\s*settings\.py\b")
MODULE_BLOCK = re.compile(r"#\s*myapp/(\w+)\.py\b")
APPLIED_SETTINGS = ("AGENTRUNS", "TASKS")
MODULE_PREFIX = "tests.testapp.docs_myapp_"  # inside an installed app, as tasks must be


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    code: str
    shown_only: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(helpers.REPO_ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [Block(path, text.count("\n", 0, found.start()) + 2, found[2], bool(found[1]))
            for found in BLOCK.finditer(text)]


# --- stand-ins for the reader's project and for provider SDKs ------------------------------

class _Ticket:
    """`Ticket.objects.create(...)`: a row of the reader's own model."""

    class objects:  # a model's manager, by its name
        ids = itertools.count(7)

        @classmethod
        def create(cls, *args: Any, **kwargs: Any) -> types.SimpleNamespace:
            return types.SimpleNamespace(pk=next(cls.ids))


class _Payments:
    """`payments.refund(proposal)`: the reader's payment service; remembers what it paid."""

    def __init__(self) -> None:
        self.refunded: list[dict[str, Any]] = []

    def refund(self, proposal: dict[str, Any]) -> None:
        self.refunded.append(proposal)


def _openai_stand_in() -> types.ModuleType:
    """The names the provider example takes from the OpenAI SDK (no network, no package)."""
    module = types.ModuleType("openai")

    class APIStatusError(Exception):
        status_code = 500

    class RateLimitError(APIStatusError):
        status_code = 429

    def create(**request: Any) -> types.SimpleNamespace:
        usage = types.SimpleNamespace(prompt_tokens=120, completion_tokens=30, total_tokens=150)
        message = types.SimpleNamespace(content="It ships today.")
        return types.SimpleNamespace(usage=usage, model=request["model"],
                                     choices=[types.SimpleNamespace(message=message)])

    class OpenAI:
        """A client whose every completion answers the same, with its usage."""

        def __init__(self, **options: Any) -> None:
            self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=create))

    module.APIStatusError = APIStatusError  # type: ignore[attr-defined]
    module.RateLimitError = RateLimitError  # type: ignore[attr-defined]
    module.OpenAI = OpenAI  # type: ignore[attr-defined]
    return module


def stand_ins() -> dict[str, Any]:
    return {"Ticket": _Ticket, "payments": _Payments(),
            "decide_amount": lambda input: 25}


# --- running a file's blocks ---------------------------------------------------------------

def adapt(code: str) -> str:
    """What a reader would change on their side: the app's name, and the tasks backport."""
    code = re.sub(r"\bfrom myapp\.(\w+) import", rf"from {MODULE_PREFIX}\1 import", code)
    if compat.SOURCE != "django.tasks":  # Django 5.2: the backport, as the guide says
        code = code.replace("from django.tasks import", "from django_tasks import")
    return code


def execute(block: Block, namespace: dict[str, Any]) -> None:
    exec(compile(adapt(block.code), block.where, "exec"), namespace)


@contextmanager
def run_document(path: Path) -> Iterator[dict[str, Any]]:
    """Run every block of `path` in order; yields the shared namespace, with the settings
    and modules the blocks made still in force."""
    blocks = [block for block in python_blocks(path) if not block.shown_only]
    if any("django.tasks" in block.code for block in blocks) and not TASKS_AVAILABLE:
        pytest.skip(UNAVAILABLE_REASON)
    agents_before = set(all_agents())
    namespace: dict[str, Any] = stand_ins()
    modules: list[str] = []
    with ExitStack() as stack:
        stack.enter_context(_module_in_place("openai", _openai_stand_in()))
        try:
            for block in blocks:
                first = block.code.lstrip().split("\n", 1)[0]
                if SETTINGS_BLOCK.match(first):
                    scope = {"DATABASES": copy.deepcopy(settings.DATABASES),
                             "INSTALLED_APPS": list(settings.INSTALLED_APPS)}
                    execute(block, scope)
                    applied = {name: scope[name] for name in APPLIED_SETTINGS if name in scope}
                    if applied:
                        stack.enter_context(override_settings(**applied))
                elif named := MODULE_BLOCK.match(first):
                    module = types.ModuleType(MODULE_PREFIX + named[1])
                    module.__dict__.update(stand_ins())
                    sys.modules[module.__name__] = module
                    modules.append(module.__name__)
                    execute(block, module.__dict__)
                    namespace.update({k: v for k, v in vars(module).items()
                                      if not k.startswith("__")})
                else:
                    execute(block, namespace)
            yield namespace
        finally:
            for name in modules:
                sys.modules.pop(name, None)
            for name in set(all_agents()) - agents_before:
                unregister(name)


@contextmanager
def _module_in_place(name: str, module: types.ModuleType) -> Iterator[None]:
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def drain(queues: list[str]) -> None:
    Worker(queues, burst=True).run(install_signals=False)


# --- the tests -----------------------------------------------------------------------------

def test_the_docs_have_examples_and_mark_what_is_shown_only() -> None:
    """The convention can only fail loudly: a block this test cannot see is a block nobody
    runs (```py, ```Python), and every file with examples has some this test runs."""
    for path in DOCUMENTS:
        text = path.read_text()
        unseen = re.findall(r"^```(py|Python|python3)\b", text, flags=re.MULTILINE)
        assert not unseen, f"{path.name}: write ```python (or ```python skip), not {unseen}"
    run = [path.name for path in DOCUMENTS
           if any(not block.shown_only for block in python_blocks(path))]
    assert {"README.md", "getting-started.md", "writing-agents.md", "waits-and-approvals.md",
            "providers-limits-budgets.md", "schedules-and-dedupe.md", "live-output.md",
            "django-tasks.md", "operations.md", "settings.md"} <= set(run)


def anchors(path: Path) -> set[str]:
    """The ids GitHub gives a file's headings (lowercased, punctuation dropped, spaces to -)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    titles = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def test_links_between_the_docs_resolve() -> None:
    """A guide moved or a heading renamed breaks no link of the README or the guides."""
    broken = []
    for path in DOCUMENTS:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", DOCUMENTS, ids=[path.name for path in DOCUMENTS])
def test_every_example_runs_as_printed(path: Path) -> None:
    with run_document(path):
        pass


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["README.md", "docs/getting-started.md"])
def test_the_first_agent_runs_to_its_output(name: str) -> None:
    with run_document(helpers.REPO_ROOT / name) as namespace:
        run = namespace["run"]
        assert run.status == "queued"
        drain(["default"])
    run = AgentRun.objects.get(pk=run.pk)
    assert (run.status, run.output) == ("succeeded", {"label": "billing"})
    steps = run.events.filter(type="step").order_by("seq")
    assert [event.payload for event in steps] == [{"n": 0}, {"n": 1}, {"n": 2}]


@pytest.mark.django_db(transaction=True)
def test_the_fork_example_runs_only_the_tail() -> None:
    with run_document(helpers.REPO_ROOT / "docs/writing-agents.md") as namespace:
        drain(["default"])
    forked = AgentRun.objects.get(pk=namespace["forked"].pk)
    assert (forked.status, forked.output) == ("succeeded", {"summary": "A C"})
    assert [event.payload for event in forked.events.filter(type="page")] == [{"n": 1}]


@pytest.mark.django_db(transaction=True)
def test_the_streaming_example_stores_its_text_once() -> None:
    with run_document(helpers.REPO_ROOT / "docs/live-output.md") as namespace:
        drain(["default"])
    run = AgentRun.objects.get(pk=namespace["run"].pk)
    assert (run.status, run.output) == ("succeeded", {"words": 4})
    stored = [event.payload for event in run.events.filter(type="stream")]
    assert [(p["channel"], p["text"]) for p in stored] == [("output", "Your order ships today. ")]
    # SQLite: the live chunks' rows go a moment after their text is stored, as the guide says
    helpers.wait_until(lambda: not StreamChunk.objects.filter(run_id=run.pk).exists(),
                       timeout=10, message="the stored chunks' rows deleted")


@pytest.mark.django_db(transaction=True)
def test_the_approval_example_waits_then_refunds_what_was_approved() -> None:
    with run_document(helpers.REPO_ROOT / "docs/waits-and-approvals.md") as namespace:
        run = namespace["run"]
        drain(["default"])
        assert AgentRun.objects.get(pk=run.pk).status == "waiting"
        approve(run.pk, "refund", by="alice", proposal={"order": 42, "amount": 20})
        drain(["default"])
        paid = namespace["payments"].refunded
    run = AgentRun.objects.get(pk=run.pk)
    assert run.output == {"refunded": 20, "approved_by": "alice"}
    assert paid == [{"order": 42, "amount": 20}]


@pytest.mark.django_db(transaction=True)
def test_the_provider_example_records_its_usage() -> None:
    with run_document(helpers.REPO_ROOT / "docs/providers-limits-budgets.md") as namespace:
        drain(["default"])
    run = AgentRun.objects.get(pk=namespace["run"].pk)
    assert (run.status, run.output) == ("succeeded", {"text": "It ships today."})
    assert (run.limit_key, run.input_tokens, run.output_tokens) == ("openai", 120, 30)
    assert run.cost == pytest.approx(150 * 0.15e-6)
    assert run.events.filter(type="run.usage").count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_django_tasks_example_runs_as_printed() -> None:
    guide = helpers.REPO_ROOT / "docs/django-tasks.md"
    with run_document(guide) as namespace:
        assert "emails" in settings.TASKS["default"]["QUEUES"]
        result, send_receipt = namespace["result"], namespace["send_receipt"]
        assert send_receipt.get_result(result.id).status == compat.TaskResultStatus.READY
        queues = re.search(r"runworker --queues ([\w,]+)", guide.read_text())
        assert queues is not None
        drain(queues[1].split(","))
        done = send_receipt.get_result(result.id)
    assert done.status == compat.TaskResultStatus.SUCCESSFUL
    assert done.return_value == "receipt for order 42 sent"
