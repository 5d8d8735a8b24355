"""The import graph of moolib's packages is layered: no module imports one that
imports it back (directly or around a loop), and packages import only those
below them.

The graph is read from the installed packages' sources with ``ast``, every
import counted wherever it sits: at the top, inside a function (a deferred
import is a dependency all the same) or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
from pathlib import Path

# Package -> the packages its modules may import. The core library knows nothing
# of the toolkit; envs build on the core; agents train on envs; launch runs
# agents. conf is the Hydra config (data), its helpers, which read the env suites
# to register their games, and the checks of settings the agents use; conf.schema,
# the run's typed settings, sits above the agents (it holds theirs) and below the
# runtimes (they read it). Inside agents: the networks, then the math, then the
# agents and their registry, then the runtimes.
ALLOWED = {
    # The core library; its __init__ alone imports moolib.replay, for the names
    # it exports (test_only_the_library_package_imports_the_replay).
    "moolib": {"moolib.replay"},
    # The replay table and its RPC side, on the library's Rpc, errors and nests.
    "moolib.replay": {"moolib"},
    "moolib.envs": {"moolib"},
    "moolib.conf": {"moolib", "moolib.envs"},
    # The run's typed settings: above the agents, whose settings they hold.
    "moolib.conf.schema": {"moolib", "moolib.envs", "moolib.conf", "moolib.agents"},
    # The networks size their policy heads by the env's action space (envs.actions).
    "moolib.agents.nets": {"moolib.envs"},
    "moolib.agents.math": {"moolib.agents.nets"},
    "moolib.agents": {
        "moolib",
        "moolib.envs",
        "moolib.agents.math",
        "moolib.agents.nets",
        "moolib.agents.runtime",  # offpolicy_run alone (test_no_agent_imports_a_runtime)
        "moolib.conf",
    },
    "moolib.agents.runtime": {
        "moolib",
        "moolib.envs",
        "moolib.conf",
        "moolib.conf.schema",
        "moolib.agents",
        "moolib.agents.math",
        "moolib.agents.nets",
    },
    "moolib.launch": {
        "moolib",
        "moolib.envs",
        "moolib.conf",
        "moolib.conf.schema",
        "moolib.agents",
        "moolib.agents.nets",
        "moolib.agents.runtime",
    },
    # The scaling modes, one module each, on the launcher they start runs with.
    "moolib.launch.scaling": {
        "moolib",
        "moolib.envs",
        "moolib.conf",
        "moolib.conf.schema",
        "moolib.agents",
        "moolib.launch",
    },
}


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    return Path(next(iter(spec.submodule_search_locations)))


def _modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package's __init__ by the
    package's), the compiled ones (moolib._core) too: they import none of ours."""
    found = {}
    for package in ALLOWED:
        folder = _package_dir(package)
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            for path in sorted(folder.glob(f"*{suffix}")):
                found[f"{package}.{path.name.removesuffix(suffix)}"] = path
        # A package inside one of these would escape the graph (and its layers).
        nested = [f"{package}.{p.parent.name}" for p in folder.glob("*/__init__.py")]
        unknown = [n for n in nested if n not in ALLOWED]
        assert not unknown, f"{package} has packages {unknown}: add them to ALLOWED"
    return found


def _ours(name: str, modules: dict[str, Path]) -> str:
    """The deepest of ``name`` and its parents that is one of ``modules`` ('' if none):
    ``import a.b.c`` depends on it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The modules of ours an import statement imports: a ``from`` import's
    names where they are modules, else the module they come from."""
    if isinstance(node, ast.Import):
        return [_ours(alias.name, modules) for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(parts[: len(parts) - node.level + 1])
        origin = f"{base}.{node.module}" if node.module else base
    else:
        origin = node.module or ""
    return [
        f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else _ours(origin, modules)
        for alias in node.names
    ]


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module it imports: the line of the first such import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        if path.suffix != ".py":
            graph[module] = edges
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.stem == "__init__", modules):
                if name and name != module:
                    edges.setdefault(name, node.lineno)
        graph[module] = edges
    return graph


def package_of(module: str) -> str:
    """The package of ``ALLOWED`` that ``module`` belongs to."""
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len)


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's cycles, one per strongly connected component of more than one
    module, each as the modules around one loop (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(set(component))
    return [_loop(graph, component) for component in components]


def _loop(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """One loop through a strongly connected ``component``: the shortest from its
    first module back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ == start:
                    return paths[node] + [start]
                if succ in component and succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def _shown(graph: dict[str, dict[str, int]], loop: list[str]) -> str:
    return " -> ".join(
        f"{a} (line {graph[a][b]})" if b else a for a, b in zip(loop, loop[1:] + [""], strict=True)
    )


def test_the_graph_sees_the_imports():
    # The checks below would pass on an empty graph; these edges are known to be there.
    graph = import_graph()
    assert "moolib.replay.server" in graph["moolib.replay.table"]
    assert "moolib.agents.registry" in graph["moolib.agents.apex"]  # relative import
    assert "moolib.envs.registry" in graph["moolib.conf.schema.run_config"]  # inside a function
    assert "moolib.envs" in graph["moolib.agents.runtime.offpolicy"]
    assert "moolib._core" in graph["moolib.rpc"]  # compiled
    assert package_of("moolib.envs.atari") == "moolib.envs"
    assert package_of("moolib.replay.table") == "moolib.replay"
    assert package_of("moolib.rpc") == "moolib"


def test_no_module_imports_itself_around_a_loop():
    graph = import_graph()
    found = [_shown(graph, loop) for loop in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_packages_import_only_the_layers_below():
    graph = import_graph()
    wrong = [
        f"{module} (line {line}) imports {target}: {package_of(module)} may import only "
        f"{', '.join(sorted(ALLOWED[package_of(module)])) or 'itself'}"
        for module, edges in sorted(graph.items())
        for target, line in sorted(edges.items())
        if package_of(target) != package_of(module)
        and package_of(target) not in ALLOWED[package_of(module)]
    ]
    assert not wrong, "\n".join(wrong)


def imports_into(package: str, target: str, allowed: str) -> list[str]:
    """The imports of ``target``'s modules by ``package``'s modules other than ``allowed``."""
    graph = import_graph()
    return [
        f"{module} (line {line}) imports {imported}"
        for module, edges in sorted(graph.items())
        if package_of(module) == package and module != allowed
        for imported, line in sorted(edges.items())
        if package_of(imported) == target
    ]


def test_no_agent_imports_a_runtime():
    # An agent names its runtime (register_agent(..., runtime="offpolicy")) and the
    # registry imports that when a run needs it: finding the agents imports none.
    # moolib.agents.offpolicy_run hands out the off-policy runtime's evaluate, on
    # the path docs/toolkit.md gives it.
    wrong = imports_into("moolib.agents", "moolib.agents.runtime", "moolib.agents.offpolicy_run")
    assert not wrong, "\n".join(wrong)


def test_only_the_library_package_imports_the_replay():
    # moolib exports ReplayClient and the lazy Replay; no other module of the
    # library builds on the replay, which builds on them.
    wrong = imports_into("moolib", "moolib.replay", "moolib")
    assert not wrong, "\n".join(wrong)


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7, "d": 1}, "d": {}}
    (loop,) = cycles(graph)
    assert loop == ["a", "b", "c", "a"]
    assert _shown(graph, loop) == "a (line 3) -> b (line 5) -> c (line 7) -> a"
    assert cycles({"a": {"b": 1}, "b": {}}) == []
