"""The import direction of docs/architecture.md, kept, per package: no lower layer imports a
higher one, and no module imports itself around a circle.

From the bottom: vocabulary and data (models, queries, states, ...) -> transitions/ ->
public calls (api, waiting, schedules, queues) -> ops/ -> streaming/ -> runtime/ -> the
app's face and UI (apps, urls, checks, admin/, management/, tasks/). So `runtime/` may
import the top level, transitions/, ops/ and streaming/ but never admin/ or management/;
`streaming/` never imports runtime/; `ops/` never imports streaming/ or runtime/;
transitions/ never imports the public calls or anything above them. Read from the source
with `ast` (tests/import_graph.py), so a deferred import inside a function counts too.
"""

from __future__ import annotations

import ast
import sys

import pytest

from tests import import_graph
from tests.import_graph import LAYERS, PACKAGE, circles, graph, layer, module_name


@pytest.mark.parametrize("name", [name for name, _ in LAYERS])
def test_no_layer_imports_a_higher_one(name: str) -> None:
    rank = [n for n, _ in LAYERS].index(name)
    edges = graph(typing=True)
    upward = {module: sorted(t for t in targets
                             if not t.startswith("missing: ") and layer(t) > rank)
              for module, targets in edges.items() if layer(module) == rank}
    assert {module: targets for module, targets in upward.items() if targets} == {}


def test_every_module_has_a_layer() -> None:
    missing = []
    for module in graph(typing=True):
        try:
            layer(module)
        except KeyError:
            missing.append(module)
    assert missing == []


def test_every_import_in_the_package_finds_its_module() -> None:
    """Not through the old paths' finder: the package itself uses the new layout."""
    missing = {module: sorted(t for t in targets if t.startswith("missing: "))
               for module, targets in graph(typing=True).items()}
    assert {module: names for module, names in missing.items() if names} == {}


def test_no_import_circle() -> None:
    assert circles(graph(typing=False)) == []


def test_the_checker_sees_relative_deferred_and_circular_imports() -> None:
    settling = PACKAGE / "transitions" / "settling.py"
    assert {"models", "outcomes", "rules.policy", "signals"} <= {
        target for target, _ in import_graph.imports(settling)}
    worker = PACKAGE / "runtime" / "worker.py"
    assert "transitions.__init__" in {target for target, _ in import_graph.imports(worker)}
    # `run_now` back in `api` would make this circle again: api -> executor -> ... -> api.
    assert circles({"api": {"runtime.executor"}, "runtime.executor": {"runtime.context"},
                    "runtime.context": {"runtime.receiving"}, "runtime.receiving": {"api"},
                    "models": set()}) == [
        ["api", "runtime.context", "runtime.executor", "runtime.receiving"]]
    assert layer("runtime.context") > layer("api")


def test_every_module_is_in_the_architecture_doc() -> None:
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = sorted(
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts and path.name != "__init__.py"
        and f"`{path.stem}`" not in doc and f"`{path.name}`" not in doc
        and f"**`{path.name}`**" not in doc)
    assert missing == []


def test_no_migration_imports_the_package() -> None:
    """A migration runs on every install for ever: code it imports may move or change."""
    offenders = sorted(
        path.name for path in (PACKAGE / "migrations").glob("0*.py")
        if any((isinstance(node, ast.ImportFrom)
                and (node.level > 0 or (node.module or "").split(".")[0] == "django_agentruns"))
               or (isinstance(node, ast.Import)
                   and any(a.name.split(".")[0] == "django_agentruns" for a in node.names))
               for node in ast.walk(ast.parse(path.read_text()))))
    assert offenders == []


def test_the_modules_of_the_flat_layout_still_import_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from django_agentruns.streaming.sse import run_events

    monkeypatch.delitem(sys.modules, "django_agentruns.stream", raising=False)
    with pytest.deprecated_call(match="django_agentruns.stream moved to"):
        from django_agentruns.stream import run_events as old_run_events
    assert old_run_events is run_events
    assert module_name(PACKAGE / "streaming" / "sse.py") == "streaming.sse"


def test_the_values_of_waiting_runs_still_import_from_their_old_module(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from django_agentruns.outcomes import Approval, DeliverResult

    monkeypatch.delitem(sys.modules, "django_agentruns.wait_results", raising=False)
    with pytest.deprecated_call(match="django_agentruns.wait_results moved to"):
        from django_agentruns.wait_results import Approval as OldApproval
        from django_agentruns.wait_results import DeliverResult as OldDeliverResult
    assert (OldApproval, OldDeliverResult) == (Approval, DeliverResult)
