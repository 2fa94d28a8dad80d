"""The layers of the house plan (docs/concepts/architecture.md, "Layers (a lower layer never imports a higher
one)"), checked over the import graph of ``hybridflow/``: no import cycle, and no import from a module to a module of
a higher layer.

The graph is read with ast (nothing is imported): one node per module (``hybridflow/x/y.py`` is ``hybridflow.x.y``,
a package's ``__init__.py`` is the package), one edge per ``import`` / ``from ... import`` of a hybridflow module,
to the most specific module it names (``from hybridflow.training import base`` points at
``hybridflow.training.base``, ``from hybridflow.training import ENGINES`` at ``hybridflow.training``). Every import
counts, for both rules: at module level, inside a function (a lazy import only moves the dependency to call time)
and under ``if TYPE_CHECKING:`` (an annotation that names a class of a higher layer still makes the lower layer know
about it). A package's implicit import of its parents' ``__init__`` is not an edge.

``LAYERS`` is the order, one number per top-level module or package of ``hybridflow`` (a longer dotted key wins).
It follows the house plan's numbering (``mapping/`` below ``trainer/``: the mapper reads the planned algorithms'
registered dataflows, :mod:`hybridflow.mapping.flows`, each naming its driver; a driver registration may add one),
with two places where the code teaches a better order:

* ``tools/`` sits below ``rollout/`` (the plan had 6 rollout, 6b tools): the multi-turn rollout calls the tools and
  builds its trajectory records from their results; a tool knows nothing of the rollout.
* the modules the plan leaves out get a place: ``errors``, ``registry`` and ``plugins`` under everything (the
  mechanism every layer registers with), the package root (its version and lazy ``DataProto``) and ``utils/``
  with ``protocol``, ``evaluation`` with the workers it resembles (it builds a model, a rollout and rewards),
  ``cli`` / ``__main__`` with ``config`` at the top.

``PENDING_CYCLES`` / ``PENDING_UPWARD`` list the known violations someone is fixing (the integrator empties them after
the merge); each must match the package exactly, so a fixed one that is still listed fails too.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import Iterable, Optional

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"

#: module or package of hybridflow -> its layer (lower never imports higher; equal layers may import each other)
LAYERS: dict[str, float] = {
    "hybridflow.errors": 0, "hybridflow.registry": 0, "hybridflow.plugins": 0,
    "hybridflow": 1, "hybridflow.protocol": 1, "hybridflow.utils": 1,
    "hybridflow.algorithms": 2,
    "hybridflow.controller": 3,
    "hybridflow.distributed": 4,
    "hybridflow.models": 4.1,  # 4a
    "hybridflow.training": 4.2,  # 4b
    "hybridflow.tools": 5,  # 6b in the plan; below the rollout, whose multi-turn loop calls the tools
    "hybridflow.rollout": 6,
    "hybridflow.engine": 7,
    "hybridflow.rewards": 7.5, "hybridflow.data": 7.5,  # 7b
    "hybridflow.workers": 8, "hybridflow.evaluation": 8,
    "hybridflow.mapping": 10,
    "hybridflow.trainer": 11,
    "hybridflow.config": 12, "hybridflow.cli": 12, "hybridflow.__main__": 12,
}

#: known import cycles (each as the set of modules of one strongly connected component), with who fixes them
PENDING_CYCLES: set[frozenset[str]] = set()  # none pending: the package has no import cycle (issue 48 item 5)

#: known upward imports (importer, imported), with who fixes them
PENDING_UPWARD: set[tuple[str, str]] = set()  # none pending: no module imports a higher layer (issue 48 item 5)


def module_name(path: Path, root: Path) -> str:
    """``hybridflow.x.y`` for ``root/hybridflow/x/y.py``; a package's ``__init__.py`` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement brings in (``from a import b`` gives ``a.b`` and ``a``: which of them is
    a module is decided against the package's modules by the caller)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(sources: dict[str, tuple[str, bool]], top: str = "hybridflow") -> dict[str, set[str]]:
    """``module -> modules it imports`` among ``sources`` (``module -> (source text, is a package)``), every import
    of the source counted, each pointing at the most specific module of ``sources`` it names."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, (text, is_package) in sources.items():
        for node in ast.walk(ast.parse(text)):
            names = _imported(node, module, is_package)
            if isinstance(node, ast.ImportFrom) and any(n in sources for n in names[:-1]):
                names = [n for n in names[:-1] if n in sources]  # from pkg import submodule(s): the submodules
            for name in names:
                if name != top and not name.startswith(top + "."):
                    continue
                while name not in sources and "." in name:
                    name = name.rpartition(".")[0]
                if name in sources and name != module:
                    graph[module].add(name)
    return graph


def package_graph() -> dict[str, set[str]]:
    sources = {module_name(p, PACKAGE.parent): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
               for p in sorted(PACKAGE.rglob("*.py"))}
    return import_graph(sources)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle path ``[a, b, ..., a]`` per strongly connected component of more than one module (or a
    module importing itself), the components found with Tarjan's algorithm (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(component)
    return [_shortest_cycle(graph, component) for component in sorted(components, key=sorted)]


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    parent: dict[str, Optional[str]] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & component):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]  # path runs from node back to start
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def layer_of(module: str, layers: dict[str, float]) -> float:
    """The layer of ``module``: that of its longest dotted prefix in ``layers``."""
    name = module
    while name not in layers:
        if "." not in name:
            raise KeyError(f"{module}: no layer in LAYERS; give its package one")
        name = name.rpartition(".")[0]
    return layers[name]


def upward(graph: dict[str, set[str]], layers: dict[str, float]) -> set[tuple[str, str]]:
    """The imports ``(importer, imported)`` of ``graph`` whose imported module sits in a higher layer."""
    return {(a, b) for a, targets in graph.items() for b in targets if layer_of(b, layers) > layer_of(a, layers)}


def _describe(items: Iterable) -> str:
    return "\n".join(f"  {item}" for item in items)


def test_the_checker_on_a_small_package():
    sources = {
        "hybridflow": ("", True),
        "hybridflow.low": ("import os\nfrom hybridflow.high import thing\n", False),
        "hybridflow.high": ("from . import low\n", False),
        "hybridflow.pkg": ("from hybridflow.pkg.b import x\n", True),
        "hybridflow.pkg.a": ("def f():\n    from hybridflow.pkg import b\n", False),
        "hybridflow.pkg.b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n", False),
        "hybridflow.pkg.c": ("import hybridflow.pkg.a.missing\nfrom hybridflow import high, pkg\n", False),
    }
    graph = import_graph(sources)
    assert graph == {"hybridflow": set(), "hybridflow.low": {"hybridflow.high"}, "hybridflow.high": {"hybridflow.low"},
                     "hybridflow.pkg": {"hybridflow.pkg.b"}, "hybridflow.pkg.a": {"hybridflow.pkg.b"},
                     "hybridflow.pkg.b": {"hybridflow.pkg.a"},
                     "hybridflow.pkg.c": {"hybridflow.pkg.a", "hybridflow.high", "hybridflow.pkg"}}
    assert cycles(graph) == [["hybridflow.high", "hybridflow.low", "hybridflow.high"],
                             ["hybridflow.pkg.a", "hybridflow.pkg.b", "hybridflow.pkg.a"]]
    layers = {"hybridflow": 0, "hybridflow.high": 2, "hybridflow.pkg": 1, "hybridflow.pkg.c": 3}
    assert upward(graph, layers) == {("hybridflow.low", "hybridflow.high")}


def test_the_shortest_cycle_of_a_larger_component():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"e"}, "e": {"a"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"a"}, "b": set()}) == [["a", "a"]]


def test_every_module_has_a_layer():
    missing = []
    for module in package_graph():
        try:
            layer_of(module, LAYERS)
        except KeyError as err:
            missing.append(str(err))
    assert not missing, "\n".join(missing)


def test_no_import_cycles():
    graph = package_graph()
    found = cycles(graph)
    components = {frozenset(c[:-1]) for c in found}
    new = [" -> ".join(c) for c in found if frozenset(c[:-1]) not in PENDING_CYCLES]
    assert not new, "import cycles (a lower module must not need a higher one back):\n" + _describe(new)
    stale = [sorted(c) for c in PENDING_CYCLES - components]
    assert not stale, "PENDING_CYCLES no longer matches the package (drop or update):\n" + _describe(stale)


def test_no_upward_imports():
    found = upward(package_graph(), LAYERS)
    new = sorted(found - PENDING_UPWARD)
    assert not new, ("imports against the layer order (move the helper down to the layer that owns it, or pass "
                     "the value in):\n" + _describe(f"{a} -> {b}" for a, b in new))
    stale = sorted(PENDING_UPWARD - found)
    assert not stale, "PENDING_UPWARD no longer matches the package (drop the fixed ones):\n" + _describe(stale)


def test_no_cycles_between_packages():
    """The same rule one level up: the top-level packages of hybridflow (``hybridflow.x``) import each other
    without a cycle (a cycle through two layers is an upward import, caught above; this catches one inside a
    layer, e.g. between ``rewards/`` and ``data/``)."""
    packages: dict[str, set[str]] = {}
    for module, targets in package_graph().items():
        top = ".".join(module.split(".")[:2])
        packages.setdefault(top, set()).update(".".join(t.split(".")[:2]) for t in targets)
        packages[top].discard(top)
    found = [c for c in cycles(packages) if not _pending_between(c)]
    assert not found, "cycles between packages:\n" + _describe(" -> ".join(c) for c in found)


def _pending_between(cycle: list[str]) -> bool:
    """Whether ``cycle`` runs through a package edge that a pending upward import carries (fixed with it)."""
    pending = {(".".join(a.split(".")[:2]), ".".join(b.split(".")[:2])) for a, b in PENDING_UPWARD}
    return any(edge in pending for edge in zip(cycle, cycle[1:]))
