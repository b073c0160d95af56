"""The package's import graph, read from the source with `ast`, and its layers.

Deferred imports (inside functions) count everywhere. Imports under `if TYPE_CHECKING:`
count for the layers (they are still a dependency of the design) but not for circles
(they never run). `python -m tests.import_graph` prints the measures: files at the top
level, import circles, upward imports, depth.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "django_agentruns"

# The layers from the bottom, by a module's first path component: each imports only its
# own layer and the ones below it.
LAYERS: list[tuple[str, set[str]]] = [
    ("vocabulary and data", {"models", "queries", "states", "outcomes", "validation", "conf",
                             "db", "exceptions", "registry", "rules", "signals", "sqlite",
                             "history_models", "flow_models", "payloads", "partitioning",
                             "operator_models"}),
    ("transitions", {"transitions"}),
    ("public calls", {"api", "waiting", "schedules", "queues"}),
    ("ops", {"ops"}),
    ("streaming", {"streaming"}),
    ("runtime", {"runtime"}),
    ("the app's face and UI", {"__init__", "apps", "urls", "checks", "admin", "management",
                               "tasks", "integrations"}),
]
# The flat layout's names, for measuring it (`git stash`-free: check out an old commit).
OLD_NAMES = {
    "ops": {"metrics", "backlog", "triage", "visibility", "diagnosis", "tracing", "pooling",
            "retention", "workers"},
    "streaming": {"chunks", "chunk_transport", "fanout", "stream"},
    "runtime": {"worker", "executor", "control", "recording", "lease_keeper", "live", "store",
                "notify", "reaper", "usage", "receiving", "context"},
}


def layer(module: str) -> int:
    """The rank of `module` (a dotted name inside the package) in LAYERS."""
    if module.startswith("missing: "):
        raise KeyError(module)
    head = module.split(".")[0]
    for rank, (name, heads) in enumerate(LAYERS):
        if head in heads or head in OLD_NAMES.get(name, ()):
            return rank
    raise KeyError(f"{module} has no layer: add it to tests/import_graph.py's LAYERS")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _is_package(module: str) -> bool:
    return (PACKAGE / module.replace(".", "/") / "__init__.py").exists()


def _file_module(module: str) -> str | None:
    """The file a dotted name inside the package lands on ("x.__init__" for a package)."""
    if module == "" or _is_package(module):
        return f"{module}.__init__".lstrip(".")
    if (PACKAGE / (module.replace(".", "/") + ".py")).exists():
        return module
    return None


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported file module, whether only under TYPE_CHECKING) for each import in `path`."""
    stat = path.stat()
    key = (str(path), str(PACKAGE), stat.st_mtime_ns, stat.st_size)
    if key not in _PARSED:  # every layer test reads the whole package: parse each file once
        _PARSED[key] = _parse_imports(path)
    return list(_PARSED[key])


_PARSED: dict[tuple[str, str, int, int], list[tuple[str, bool]]] = {}


def _parse_imports(path: Path) -> list[tuple[str, bool]]:
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).split(".")[:-1]
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(inner) for child in node.body for inner in ast.walk(child))
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name.partition(".")[2] for alias in node.names
                     if alias.name.split(".")[0] == "django_agentruns"]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if (node.module or "").split(".")[0] != "django_agentruns":
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                base = package[:len(package) - (node.level - 1)] + \
                    (node.module.split(".") if node.module else [])
            dotted = ".".join(base)
            for alias in node.names:  # `from . import x` imports the module x
                sub = _file_module(f"{dotted}.{alias.name}".lstrip("."))
                names.append(sub.removesuffix(".__init__") if sub else dotted)
        for name in names:
            target = _file_module(name)
            if target is None:  # a module that is not there (an old path, say)
                target = f"missing: {name}"
            if target != module_name(path):
                found.append((target, id(node) in typing_only))
    return found


def sources() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if "migrations" not in path.parts]


def graph(*, typing: bool) -> dict[str, set[str]]:
    """Module -> the modules it imports (with or without the TYPE_CHECKING-only ones)."""
    return {module_name(path): {target for target, typing_only in imports(path)
                                if typing or not typing_only} for path in sources()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, around a circle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if layer(b) > layer(a))


def depth(edges: dict[str, set[str]]) -> int:
    """Floors: the longest chain of imports, a circle counted as one floor."""
    group = {m: ",".join(g) for g in circles(edges) for m in g}
    memo: dict[str, int] = {}

    def floors(v: str) -> int:
        key = group.get(v, v)
        if key not in memo:
            memo[key] = 0  # guards the walk inside a circle
            memo[key] = 1 + max((floors(w) for w in edges.get(v, ())
                                 if group.get(w, w) != key), default=0)
        return memo[key]

    return max(floors(v) for v in edges)


def main() -> None:
    running, every = graph(typing=False), graph(typing=True)
    print(f"files at the top level: {len(list(PACKAGE.glob('*.py')))}")
    print(f"import circles: {len(circles(running))}")
    for group in circles(running):
        print("   ", " <-> ".join(group))
    print(f"upward imports: {len(upward(every))}")
    for line in upward(every):
        print("   ", line)
    print(f"depth (floors): {depth(running)}")


if __name__ == "__main__":
    main()
