"""Code-shape figures of the package, measured with ``ast``: the fraction of typed function arguments per package
(``self``/``cls`` excluded; ``*args``/``**kwargs`` count), function lengths and file lengths.

Run ``python tests/test_code_shape.py`` for the table of every package. The test asserts the packages that meet the
bar today (the others are reported, not asserted, until they are brought there).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"
TYPED_BAR = 0.95
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
ASSERTED_TYPED = ("trainer",)  # packages held to TYPED_BAR by this test


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> list[ast.arg]:
    a = fn.args
    args = [*a.posonlyargs, *a.args]
    if in_class and args and args[0].arg in ("self", "cls"):
        args = args[1:]
    return args + [*a.kwonlyargs] + [x for x in (a.vararg, a.kwarg) if x is not None]


def _methods(tree: ast.AST) -> set[ast.AST]:
    return {n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else "(top level)"


def typed_fraction() -> dict[str, tuple[int, int]]:
    """Package -> (typed arguments, all arguments)."""
    out: dict[str, tuple[int, int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        methods = _methods(tree)
        typed = total = 0
        for fn in _functions(tree):
            for arg in _arguments(fn, fn in methods):
                total += 1
                typed += arg.annotation is not None
        t, n = out.get(package_of(path), (0, 0))
        out[package_of(path)] = (t + typed, n + total)
    return out


def long_functions(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for fn in _functions(ast.parse(path.read_text())):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{fn.lineno} {fn.name} ({lines} lines)")
    return found


def long_files(paths: list[Path]) -> list[str]:
    return [f"{p.relative_to(PACKAGE.parent)} ({n} lines)" for p in paths
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]


def test_typed_arguments_in_the_asserted_packages():
    fractions = typed_fraction()
    for package in ASSERTED_TYPED:
        typed, total = fractions[package]
        assert typed / total >= TYPED_BAR, f"{package}: {typed}/{total} = {typed / total:.1%} typed"


def test_trainer_functions_and_files_within_bounds():
    paths = sorted((PACKAGE / "trainer").glob("*.py"))
    assert long_functions(paths) == []
    assert long_files(paths) == []


if __name__ == "__main__":
    for package, (typed, total) in sorted(typed_fraction().items()):
        print(f"{package:14s} {typed:5d}/{total:<5d} {typed / max(total, 1):6.1%}")
    paths = sorted(PACKAGE.rglob("*.py"))
    for line in long_functions(paths) + long_files(paths):
        print("over the limit:", line, file=sys.stderr)
