"""The package's layering (CONTRIBUTING.md, "The map"): no import circle, no lower module importing the trainer, no
module over 400 lines (the config dataclass aside). Read from the source with ast, so a function-local import counts
like a top-level one."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "marble_trl"
MAX_LINES = 400
# The modules that use the trainer (a higher layer than it): the package's front door, the commands, the benchmark,
# and the preflight's steps that run the trainer constructor's checks (marble-trl check).
TRAINER_USERS = {"marble_trl", "marble_trl.nft_trainer", "marble_trl.commands.train", "marble_trl.shapesbench.bench",
                 "marble_trl.preflight.run", "marble_trl.preflight.measure"}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (``from . import x`` -> the submodule)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                submodules = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
                # `from . import a, b` of submodules imports those modules (the package is already being imported)
                targets = submodules if len(submodules) == len(node.names) else [mod, *submodules]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    cycles = _cycles(import_graph())
    assert not cycles, f"import circles (function-local imports included): {cycles}"


def test_the_cycle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += graph[v]
    return seen


def test_the_benchmark_is_outside_the_core():
    """Nothing the trainer or the CLI's train command imports (function-local imports included) is ShapesBench: its
    rewards and prompt sources are reached through name tables, as a user's would be."""
    graph = import_graph()
    for start in ("marble_trl.trainer.trainer", "marble_trl.nft_trainer", "marble_trl.commands.train"):
        inside = sorted(m for m in _closure(graph, start) if m.startswith("marble_trl.shapesbench"))
        assert not inside, f"{start} imports the benchmark: {inside}"


def test_no_lower_module_imports_the_trainer():
    graph = import_graph()
    offenders = sorted(
        name
        for name, targets in graph.items()
        if not name.startswith("marble_trl.trainer")
        and name not in TRAINER_USERS
        and any(t == "marble_trl.trainer" or t.startswith("marble_trl.trainer.") for t in targets)
    )
    assert not offenders, f"modules below the trainer that import it: {offenders}"


# The config dataclass is one list of documented public fields (each a few lines of help): splitting it by line count
# would split one concept. Its size is bounded by the fields, not by code.
CONFIG_MODULE = "marble_trl.nft_config"


def test_no_module_over_400_lines():
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _modules().items()}
    big = {name: n for name, n in sizes.items() if n > MAX_LINES and name != CONFIG_MODULE}
    assert not big, f"modules over {MAX_LINES} lines (split them by what they hold): {big}"


# CONTRIBUTING.md's map says where things live: it must stay right ----------------------------------------------------

ROOT = PACKAGE.parent


def _map_section() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    return text[text.index("## The map") : text.index("## Conventions")]


def _defines(path: Path, name: str) -> bool:
    source = path.read_text(encoding="utf-8")
    return any(
        isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name
        or isinstance(node, ast.Assign | ast.AnnAssign)
        and name in {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)}
        for node in ast.walk(ast.parse(source))
    )  # fmt: skip


def test_the_contributing_map_names_modules_and_classes_that_exist():
    section = _map_section()

    def find(path: str, packages: tuple[str, ...] = ()) -> Path | None:
        for base in (ROOT, PACKAGE, PACKAGE / "trainer", *(PACKAGE / p for p in packages)):
            if (base / path).exists():
                return base / path
        return None

    checked = 0
    # every path: `balance/registry.py`, `rewards/`, "(trainer.py)" in the step diagram; a bullet naming packages
    # (`data/`: `prompts.py`, ...) names modules inside them
    for bullet in re.split(r"\n(?=- |\S)", section):
        packages = tuple(re.findall(r"`([\w/]+/)`", bullet))
        paths = set(re.findall(r"`([\w./]+(?:\.py|/))`", bullet)) | set(re.findall(r"\(([\w/]+\.py)[:)]", bullet))
        for path in sorted(paths):
            assert find(path, packages) is not None, f"CONTRIBUTING.md names {path}, which does not exist"
            checked += 1
    # every "name (module.py)" of the step diagram is defined in that module
    for name, path in re.findall(r"^\s+(?:-> |\()?(\w+) \(([\w/]+\.py)\)", section, re.M):
        assert _defines(find(path), name), f"CONTRIBUTING.md: {name} is not defined in {path}"
        checked += 1
    # every dotted `module.Name` imports; every CamelCase `Name` is defined somewhere in the package
    for dotted in re.findall(r"`((?:[a-z_]+\.)+[A-Za-z_]+)`", section):
        if dotted.endswith(".py"):
            continue
        module, _, attr = dotted.removeprefix("marble_trl.").rpartition(".")
        assert hasattr(importlib.import_module(f"marble_trl.{module}"), attr), f"CONTRIBUTING.md: {dotted}"
        checked += 1
    files = list(PACKAGE.rglob("*.py"))
    for name in set(re.findall(r"`([A-Z][A-Za-z]+|[A-Z_]{4,})`", section)):
        assert any(_defines(f, name) for f in files), f"CONTRIBUTING.md names {name}, defined nowhere in the package"
        checked += 1
    assert checked > 40
