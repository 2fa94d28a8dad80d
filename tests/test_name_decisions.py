"""No code decides on the name of a registry entry: ``== "gae"``, ``!= "hf"``, ``in ("vllm", ...)``, ``== "aipo"``
and the like are replaced by the metadata the entry declares (``needs_values``, ``uses_hybrid_engine``,
``requires_package``, ``corrects_off_policy``, ...). Nor does code keep its own table of registered names
(``("hf", "vllm")``, ``{"ppo": "gae", ...}``): what such a table says is metadata of the entries.

``NAMES`` is built from the package itself: every module of ``hybridflow/`` is imported (which registers the
built-in entries, drivers included) and every :class:`~hybridflow.registry.Registry` the package defines at module
level (found with ast, so a new registry is covered without editing this test) gives all its names; to those add
the fixed name tables the config checks names against (``NAME_TABLES``: the loss aggregation modes and KL
estimators) and the kinds that still lack a registry (``UNREGISTERED``).

The test parses every module (ast, so comments, docstrings and messages do not count) and fails on
* a comparison (``==``, ``!=``, ``in``, ``not in``, ``is``, ``is not``) of anything with one of ``NAMES``;
* a name table: a tuple, list or set literal of two or more strings that are all in ``NAMES``, or a dict literal
  whose keys or whose values are; literals inside a registration call (``register_*(...)``, ``.register(...)``:
  the entry's own metadata) do not count.

Generic words: some registered names are ordinary words (``abs``, ``kl``, ``mse``, ``http``, ``arith``), and the
tensor-parallel plans are named after Hugging Face ``model_type`` values that model code may rightly compare. Such a
site is not a decision among registry entries: it goes into ``UNRELATED`` with the reason, per file and name. Today
no ordinary word collides; the only entry is an architecture fact of Qwen2.

``PENDING`` lists known sites still to be swapped for metadata, with who swaps them (the integrator empties it after
the merge); a pending site that disappears fails the test too, so the list cannot go stale; ``UNRELATED`` alike.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"
NAME_TABLES = (("hybridflow.algorithms", "LOSS_AGG_MODES"), ("hybridflow.algorithms", "KL_PENALTY_TYPES"))
UNREGISTERED: set[str] = set()  # names of a kind that has no registry (none: the KL controllers have one now)

#: file -> the names it still decides on until it is swapped for registry metadata
PENDING: dict[str, set[str]] = {}  # none left after the merge of the registries' own metadata

#: file -> names it compares or tabulates that are no decision among registry entries (and why)
UNRELATED: dict[str, set[str]] = {
    "models/megatron_convert.py": {"qwen2"},  # Qwen2 checkpoints carry q/k/v biases: an HF architecture fact
}

_COMPARE = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def registry_sites(source: str) -> list[str]:
    """The module-level names ``source`` binds to a ``Registry(...)`` call."""
    found = []
    for node in ast.parse(source).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        func = value.func if isinstance(value, ast.Call) else None
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if called == "Registry":
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [t.id for t in targets if isinstance(t, ast.Name)]
    return found


def registered_names() -> dict[str, set[str]]:
    """``kind -> names`` of every registry of the package (all modules imported first) and of ``NAME_TABLES``."""
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__main__.py"]
    for path in paths:
        importlib.import_module(_module(path))
    names: dict[str, set[str]] = {}
    for path in paths:
        for attr in registry_sites(path.read_text(encoding="utf-8")):
            registry = getattr(importlib.import_module(_module(path)), attr)
            names.setdefault(registry.kind, set()).update(registry.names())
    for module, attr in NAME_TABLES:
        names[attr] = set(getattr(importlib.import_module(module), attr))
    names["unregistered"] = set(UNREGISTERED)
    return names


def _strings(nodes: list) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _registration_literals(tree: ast.Module) -> set[int]:
    """ids of the nodes inside the arguments of a registration call (``register...(...)``, ``X.register(...)``),
    and inside the module-level constants those arguments name (``register_reward(*MATH_DATA_SOURCES)``)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.startswith("register"):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    inside.update(id(n) for n in ast.walk(arg))
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) in inside}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in named for t in node.targets):
            inside.update(id(n) for n in ast.walk(node.value))
    return inside


def name_decisions(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every comparison with, and every name table of, ``names`` in ``source``."""
    tree = ast.parse(source)
    skip = _registration_literals(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, _COMPARE) for op in node.ops):
            for operand in [node.left, *node.comparators]:
                items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                found.extend((node.lineno, n) for n in sorted(set(_strings(items)) & names))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and id(node) not in skip:
            groups = [node.keys, node.values] if isinstance(node, ast.Dict) else [node.elts]
            for group in groups:
                strings = _strings(group)
                if len(strings) >= 2 and len(strings) == len(group) and set(strings) <= names:
                    found.extend((node.lineno, n) for n in sorted(set(strings)))
    return sorted(set(found))


def test_the_checker_finds_the_forms_it_forbids():
    source = ('a = x == "gae"\nb = "hf" != y\nc = z in ("vllm", "other")\nd = {"aipo": 1}\ne = f("hf")\n'
              'T = ("hf", "vllm")\nU = {"ppo": "gae", "x": "grpo"}\nV = ["hf", "other"]\n'
              '@register_driver("ppo", planned_as=("ppo", "grpo"))\nclass P: pass\n'
              'R.register("hf", like=["hf", "gae"])\n'
              'S = ("hf", "vllm")\n@register_x(*S)\ndef g(): pass\n')
    names = {"gae", "hf", "vllm", "aipo", "ppo", "grpo"}
    assert name_decisions(source, names) == [(1, "gae"), (2, "hf"), (3, "vllm"), (6, "hf"), (6, "vllm"),
                                             (7, "gae"), (7, "grpo")]


def test_registry_sites_are_found_in_their_forms():
    source = 'A: Registry = Registry("a")\nB = registry.Registry("b")\nC = make()\ndef f():\n    D = Registry("d")\n'
    assert registry_sites(source) == ["A", "B"]


@pytest.fixture(scope="module")
def names() -> dict[str, set[str]]:
    return registered_names()


def test_names_come_from_every_registry(names):
    # a sample of each kind, written out by hand: the test reads them from the registries, not from a list
    expected = {"advantage estimator": {"gae", "grpo", "rloo"}, "policy loss": {"vanilla", "aipo"},
                "rollout backend": {"hf", "vllm"}, "training engine": {"fsdp2", "megatron"},
                "driver": {"ppo", "remax", "safe_rlhf", "async"}, "tool": {"calculator"},
                "reward": {"openai/gsm8k"}, "KL_PENALTY_TYPES": {"low_var_kl", "k3"},
                "LOSS_AGG_MODES": {"token-mean"}}
    missing = {kind: sample - names.get(kind, set()) for kind, sample in expected.items()}
    assert not any(missing.values()), f"names not collected: {missing}"


def test_no_name_decisions_outside_the_registries(names):
    every = set().union(*names.values())
    found: dict[str, set[str]] = {}
    lines = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in name_decisions(path.read_text(encoding="utf-8"), every):
            found.setdefault(rel, set()).add(name)
            if name not in PENDING.get(rel, set()) | UNRELATED.get(rel, set()) | _own_table(rel, name):
                lines.append(f"hybridflow/{rel}:{line}: decides on {name!r}")
    assert not lines, ("decide on what the entry declares (registry metadata), not on its name:\n"
                       + "\n".join(lines))
    for table, listed in (("PENDING", PENDING), ("UNRELATED", UNRELATED)):
        stale = {rel: names for rel, names in listed.items() if not names <= found.get(rel, set())}
        assert not stale, f"{table} no longer matches the package (remove what is gone): {stale}"


def _own_table(rel: str, name: str) -> set[str]:
    """The names of a fixed name table in the module that defines it (its ``dict`` of name -> function)."""
    own = {"algorithms/aggregation.py": "LOSS_AGG_MODES", "algorithms/kl.py": "KL_PENALTY_TYPES"}
    if rel not in own:
        return set()
    table = set(getattr(importlib.import_module("hybridflow.algorithms"), own[rel]))
    return table if name in table else set()
