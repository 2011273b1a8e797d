"""memfit's imports: no cycle, layers that point down (README "Layout" says them), only memfit/cli/ imports prefect."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
PACKAGE = Path(__file__).resolve().parents[2] / "memfit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, name: str, module_level_only: bool) -> set[str]:
    """Absolute names this module imports (relative imports resolved), at module level or anywhere."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if _type_checking_only(node):
            return  # annotations only: never run
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if module_level_only and in_function:
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(tree, False)
    return found


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path, name, module_level_only) if m in modules and m != name}
            for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path a -> b -> ... -> a, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_the_graph_sees_memfit_imports():
    graph = _graph(module_level_only=False)
    assert "memfit.checkpoints.index" in graph["memfit.checkpoints.manager"]
    assert "memfit.training.loop" in graph["memfit.phases"]  # a function-level import counts here


def test_no_import_cycle_at_module_level():
    cycle = _find_cycle(_graph(module_level_only=True))
    assert cycle is None, "import cycle among memfit's modules: " + " -> ".join(cycle or [])


def test_no_import_cycle_counting_imports_inside_functions():
    # Deferred imports are how cycles hide: counted too, so a package's layers point one way.
    cycle = _find_cycle(_graph(module_level_only=False))
    assert cycle is None, "import cycle (counting function-level imports): " + " -> ".join(cycle or [])


def _in_cli(name: str) -> bool:
    return name == "memfit.cli" or name.startswith("memfit.cli.")


def test_the_core_never_imports_prefect():
    offenders = sorted(name for name, path in _modules().items() if not _in_cli(name)
                       and any(m == "prefect" or m.startswith("prefect.")
                               for m in _imports(path, name, module_level_only=False)))
    assert offenders == [], f"these memfit modules import prefect (only memfit/cli/ may): {offenders}"

# Bottom to top; README.md's "Layout" section says them in the words layers_text() renders (a test below checks).
# Packages in one layer may import each other (the cycle test keeps that one-way); a module imports only from its
# own layer and the layers below it. config is on the floor: it imports only errors, and runtime reads it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("memfit", "memfit.config", "memfit.errors", "memfit.files", "memfit.reports")),
    ("platform", ("memfit.runtime", "memfit.storage", "memfit.tracking")),
    ("inputs", ("memfit.models", "memfit.data")),
    # memory/'s three parts, one way: the trainer and the estimator use the techniques, the planner the estimator.
    ("techniques", ("memfit.memory", "memfit.memory.techniques")),
    ("estimator", ("memfit.memory.estimator",)),
    ("planner and state", ("memfit.memory.planner", "memfit.checkpoints")),
    ("training", ("memfit.training", "memfit.distributed")),
    ("phase 5", ("memfit.evaluation", "memfit.release", "memfit.server")),
    # The spine, and the entry points of memfit's other processes (a torchrun rank, the tracking process),
    # which compose every layer below as the CLI does.
    ("spine", ("memfit.preflight", "memfit.run_context", "memfit.phases", "memfit.profile", "memfit.profile_trace",
               "memfit.cli", "memfit.distributed.worker", "memfit.tracking.child")),
]


def layer_of(module: str) -> int:
    """The layer of a module: the longest listed prefix wins (memfit.config.release sits with memfit.config)."""
    best, index = "", -1
    for i, (_, members) in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and len(member) > len(best):
                best, index = member, i
    return index


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer '{LAYERS[layer_of(a)][0]}') imports {b} (layer '{LAYERS[layer_of(b)][0]}')"
                  for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _graph(module_level_only=False) if layer_of(m) < 0)
    assert unplaced == [], f"modules in no layer (add their package to LAYERS): {unplaced}"


def test_imports_go_down_never_up():
    problems = upward_imports(_graph(module_level_only=False))
    assert problems == [], "imports from a lower layer to a higher one:\n" + "\n".join(problems)


def test_the_layer_check_catches_an_upward_import():
    graph = {"memfit.data.packing": {"memfit.training.loop"}, "memfit.training.loop": {"memfit.data.packing"}}
    assert upward_imports(graph) == ["memfit.data.packing (layer 'inputs') imports memfit.training.loop "
                                     "(layer 'training')"]
    assert layer_of("memfit.config.release") == 0 and layer_of("memfit.cli") == len(LAYERS) - 1
    # memory/'s arrows: a technique never reaches up into the estimator or planner, nor the estimator into the
    # planner, nor any of memory/ into training/ (the loop and what it runs).
    for a, b in [("memfit.memory.techniques.policies", "memfit.memory.estimator.tracker"),
                 ("memfit.memory.techniques.loss", "memfit.memory.planner.search"),
                 ("memfit.memory.estimator.estimate", "memfit.memory.planner.plan"),
                 ("memfit.memory.planner.monitor", "memfit.training.loop")]:
        assert upward_imports({a: {b}}) != [], (a, b)
    assert upward_imports({"memfit.training.loop": {"memfit.memory.techniques.optim"},
                           "memfit.memory.planner.search": {"memfit.memory.estimator.estimate"}}) == []


def test_memory_arrows_run_one_way():
    """The trainer and the estimator use the techniques, the planner uses the estimator; nothing points back."""
    order = ("memfit.memory.techniques", "memfit.memory.estimator", "memfit.memory.planner", "memfit.training")

    def rank(module: str) -> int:
        return next((i for i, p in enumerate(order) if module == p or module.startswith(p + ".")), -1)

    back = sorted(f"{a} imports {b}" for a, targets in _graph(module_level_only=False).items() for b in targets
                  if 0 <= rank(a) < rank(b))
    assert back == [], "memory/'s arrows point back:\n" + "\n".join(back)


def test_the_root_holds_only_the_spine():
    roots = sorted(m for m in _graph(module_level_only=False) if m.count(".") == 1 and not _is_package(m))
    assert len(roots) <= 8, f"memfit/ root modules (at most 8, the spine): {roots}"


def _is_package(module: str) -> bool:
    return (PACKAGE / module.split(".", 1)[1] / "__init__.py").is_file()


def layers_text() -> str:
    """LAYERS as README.md's Layout section says them: `layer: member, ...` bottom to top, joined by arrows; a
    member is its path under memfit/ (a module lifted out of its folder shows it: distributed/worker)."""
    def path(member: str) -> str:
        return member.removeprefix("memfit.").replace(".", "/")

    every = [m for _, members in LAYERS for m in members]

    def placed_by_parts(member: str) -> bool:  # memfit.memory: each of its modules is placed by a longer name
        inside = [m for m in _modules() if m.startswith(member + ".")]
        return bool(inside) and all(any(m == o or m.startswith(o + ".") for o in every if o.startswith(member + "."))
                                    for m in inside)

    shown = [[m for m in members if m != "memfit" and not placed_by_parts(m)] for _, members in LAYERS]
    return " → ".join(f"{name}: " + ", ".join(map(path, members)) for (name, _), members in zip(LAYERS, shown,
                                                                                                strict=True))


def test_the_readme_says_these_layers():
    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    said = " ".join(section.split())  # the README wraps the line where it likes
    assert layers_text() in said, f"README.md's Layout section does not say the layers as LAYERS has them:\n" \
                                  f"{layers_text()}"
