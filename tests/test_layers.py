"""The import direction of docs/architecture.md, kept: no lower layer imports a higher one.

UI/commands -> api and queries -> transitions -> models; worker -> executor -> transitions.
Read from the source with `ast`, so a deferred import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "django_agentruns"

# Modules (or packages) the layer on the left must never import.
HIGHER = ["admin", "api", "worker", "executor", "lease_keeper", "live", "management",
          "tasks", "views", "urls", "stream", "fanout", "reaper", "recording", "store",
          "context", "control", "receiving", "waiting", "schedules", "triage", "pooling"]
# The worker side's inner roles, which the public calls and the UI never import.
WORKER_SIDE = ["worker", "executor", "lease_keeper", "live", "store", "recording"]
FORBIDDEN: dict[str, list[str]] = {
    "transitions": HIGHER,
    "models.py": ["transitions", *HIGHER],  # queries sits with models (the manager)
    "queries.py": ["transitions", *HIGHER],
    "outcomes.py": ["transitions", "models", "queries", *HIGHER],
    "policy.py": ["transitions", "models", "queries", *HIGHER],
    "validation.py": ["transitions", "models", "queries", *HIGHER],
    "executor.py": ["worker", "lease_keeper", "live", "admin", "api", "management"],
    "recording.py": ["worker", "executor", "lease_keeper", "live", "admin", "api",
                     "management"],
    "live.py": ["worker", "lease_keeper", "admin", "api"],
    "lease_keeper.py": ["worker", "executor", "admin", "api"],
    "store.py": ["worker", "executor", "admin", "api"],
    "wait_results.py": ["transitions", "models", "queries", *HIGHER],
    "ticks.py": ["transitions", "models", "queries", *HIGHER],
    "diagnosis.py": ["transitions", *HIGHER],
    "workers.py": ["transitions", *HIGHER],
    "queues.py": ["transitions", *HIGHER],
    "triage.py": ["transitions", *HIGHER],
    "pooling.py": ["transitions", "models", *HIGHER],
    "control.py": [*WORKER_SIDE[:-2], "admin", "api", "management", "context", "recording"],
    "context.py": [*WORKER_SIDE, "admin", "api", "management"],
    "receiving.py": [*WORKER_SIDE, "admin", "management"],
    "waiting.py": [*WORKER_SIDE, "admin", "management", "control"],
    "schedules.py": [*WORKER_SIDE, "admin", "management", "transitions"],
    "admin": ["transitions", *WORKER_SIDE, "control"],
    "management": ["transitions", "executor", "lease_keeper", "live", "store", "recording",
                   "control", "admin"],
    # Live output: the attempt side (context calls it) under the executor; the transport
    # under both it and the web fan-out, beside models.
    "chunks.py": ["worker", "executor", "lease_keeper", "live", "recording", "store",
                  "context", "admin", "api", "management", "views", "urls", "tasks"],
    "chunk_transport.py": ["transitions", "chunks", *HIGHER],
    # Flow control (issue 17): pure checks; the usage of an attempt; the limited claim,
    # snoozes and usage writes (in transitions); the limits admin.
    "limits.py": ["transitions", "models", "queries", "usage", *HIGHER],
    "usage.py": ["worker", "executor", "lease_keeper", "live", "recording", "admin", "api",
                 "management", "context"],
    "transitions/limited.py": [*HIGHER, "usage"],
    "transitions/snoozing.py": [*HIGHER, "usage"],
    "admin/limits.py": ["transitions", "worker", "executor", "lease_keeper", "live", "store",
                        "recording", "control", "usage"],
}


def imported(path: Path) -> set[str]:
    """First component, within the package, of every module `path` imports."""
    tree = ast.parse(path.read_text(), str(path))
    relative_to = path.relative_to(PACKAGE).parts[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "django_agentruns" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "django_agentruns":
                    continue
                base = parts[1:]
            else:
                up = relative_to[:len(relative_to) - (node.level - 1)]
                base = [*up, *((node.module or "").split(".") if node.module else [])]
            if base:
                found.add(base[0])
            else:  # `from . import x, y`
                found.update(alias.name for alias in node.names)
    return found


def sources(layer: str) -> list[Path]:
    target = PACKAGE / layer
    return sorted(target.rglob("*.py")) if target.is_dir() else [target]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_lower_layer_imports_a_higher_one(layer: str) -> None:
    own = layer.removesuffix(".py")
    bad = {str(path.relative_to(PACKAGE)): sorted(
        (imported(path) - {own}) & {m.removesuffix(".py") for m in FORBIDDEN[layer]})
        for path in sources(layer)}
    assert {path: names for path, names in bad.items() if names} == {}


def test_the_checker_sees_relative_and_deferred_imports() -> None:
    tree_file = PACKAGE / "transitions" / "settling.py"
    assert {"models", "outcomes", "policy", "signals"} <= imported(tree_file)
    assert "transitions" in imported(PACKAGE / "worker.py")


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
