"""No code decides on the name of a registry entry: ``== "gae"``, ``!= "hf"``, ``in ("vllm", ...)``, ``== "aipo"``
and the like are replaced by the metadata the entry declares (``needs_values``, ``uses_hybrid_engine``,
``requires_package``, ``corrects_off_policy``, ...). The test parses every module of the package (ast, so comments,
docstrings and messages do not count) and fails on a comparison of anything with one of those names.

``PENDING`` lists known call sites still to be swapped for metadata (none today); a pending site that disappears
fails the test too, so the list cannot go stale.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"
NAMES = {"gae", "hf", "vllm", "aipo"}
PENDING: dict[str, set[str]] = {}  # file -> the names it still decides on (none left after the merge)
_COMPARE = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _names_in(node: ast.AST) -> set[str]:
    """The registry names among a comparison operand: a string constant, or the strings of a tuple/list/set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES}


def name_decisions(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every comparison of something with one of ``NAMES`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, _COMPARE) for op in node.ops):
            for operand in [node.left, *node.comparators]:
                found.extend((node.lineno, name) for name in sorted(_names_in(operand)))
    return found


def test_the_checker_finds_the_forms_it_forbids():
    source = 'a = x == "gae"\nb = "hf" != y\nc = z in ("vllm", "other")\nd = {"aipo": 1}\ne = f("hf")\n'
    assert name_decisions(source) == [(1, "gae"), (2, "hf"), (3, "vllm")]


def test_no_name_decisions_outside_the_registries():
    found: dict[str, set[str]] = {}
    lines = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name in name_decisions(path.read_text(encoding="utf-8")):
            found.setdefault(rel, set()).add(name)
            lines.append(f"hybridflow/{rel}:{line}: decides on {name!r}")
    unexpected = [line for line in lines if line.split(":")[0][len("hybridflow/"):] not in PENDING]
    assert not unexpected, "decide on what the entry declares (registry metadata), not on its name:\n" + "\n".join(
        unexpected)
    stale = {rel: names for rel, names in PENDING.items() if found.get(rel) != names}
    assert not stale, f"PENDING no longer matches the package (remove the swapped sites): {stale}"
