"""Guard: no test, module, benchmark or example names an absolute path of a machine as input.

A fresh clone on a fresh machine holds nothing but the repository, so every file a test or the package reads
lies in the repository (located from ``__file__``), in the test's ``tmp_path`` (or ``tempfile``'s directory),
or in a system location every Linux box has. This test scans string literals in the Python sources (docstrings
are documentation, not inputs, and are skipped) and the values of the YAML/JSON/shell files under the scanned
folders, and fails on any absolute path outside that allowlist, e.g. ``/work/main/...``, ``/root/...`` or a
hard-coded ``/tmp/...`` (use ``tmp_path`` or ``tempfile`` instead).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("hybridflow", "tests", "benchmarks", "examples", ".ci")
TEXT_SUFFIXES = (".yaml", ".yml", ".json", ".sh", ".toml", ".cfg", ".ini", "")
# First path components every Linux machine has (devices, kernel views, the OS and its libraries). /tmp is not
# here: a test's own directory comes from tmp_path / tempfile, never from a literal.
SYSTEM_ROOTS = frozenset({"dev", "proc", "sys", "usr", "bin", "sbin", "lib", "lib64", "etc"})
# An absolute path: a "/" that does not continue a word, a relative path, a placeholder or a URL, then a name.
ABSOLUTE = re.compile(r"(?<![\w.~/:$<>*})\]\\-])/([A-Za-z_][\w.+-]*)(/[^\s'\"`,;:)\]}]*)?")
TEMP_ROOT = "/tmp"  # allowed bare, as tempfile's ``dir=`` (Ray needs short socket paths); never /tmp/<name>


def foreign_paths(text: str) -> list[str]:
    """The absolute paths in ``text`` whose first component is not a system root (the bare ``/tmp`` is
    allowed as a directory for ``tempfile``; a path below it is not)."""
    return [m.group(0) for m in ABSOLUTE.finditer(text)
            if m.group(1) not in SYSTEM_ROOTS and m.group(0).rstrip("/") != TEMP_ROOT]


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _joined(node: ast.JoinedStr) -> str:
    """An f-string's text with each ``{...}`` replaced by a word, so ``f"{out}/metrics.jsonl"`` reads as
    relative (it continues a value) while ``f"/root/{name}"`` stays absolute."""
    return "".join(part.value if isinstance(part, ast.Constant) else "X" for part in node.values)


def python_literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of every string literal and f-string of a Python source except docstrings."""
    tree = ast.parse(source)
    skip = _docstring_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append((node.lineno, _joined(node)))
            skip.update(id(part) for part in node.values)
    out += [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip]
    return out


def text_lines(text: str) -> list[tuple[int, str]]:
    """(line, content) of a YAML/shell/TOML file with ``#`` comments removed."""
    return [(i, re.sub(r"(^|\s)#.*$", "", line)) for i, line in enumerate(text.splitlines(), 1)]


def _scanned_files() -> list[Path]:
    files = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*")):
            if "__pycache__" in path.parts or not path.is_file() or path.is_symlink():
                continue
            if path.suffix == ".py" or path.suffix in TEXT_SUFFIXES and path.stat().st_size < 1 << 20:
                files.append(path)
    return files


def _offences(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []  # binary (weights)
    items = python_literals(text) if path.suffix == ".py" else text_lines(text)
    return [f"{path.relative_to(REPO)}:{line}: {found}" for line, value in items for found in foreign_paths(value)]


def test_no_source_names_a_path_outside_the_repository():
    files = _scanned_files()
    assert any(p.name == "test_no_foreign_paths.py" for p in files)  # the scan sees the test folder
    # this file's own examples of bad paths (the parametrized cases below) are data for the guard, not inputs
    offences = [o for path in files if path != Path(__file__).resolve() for o in _offences(path)]
    assert not offences, "absolute paths outside the repository (use tmp_path, tempfile or a path from " \
                         "__file__):\n" + "\n".join(offences)


@pytest.mark.parametrize("text", [
    "actor_rollout_ref.model.path=/tmp/tiny", "/opt/venvs/hf/bin/python", '"/root/data.parquet"',
    "trainer.default_local_dir=/home/user/runs", "--input /data/gsm8k/test.jsonl", "/mnt/shared/ckpt",
])
def test_guard_catches_machine_paths(text):
    assert foreign_paths(text)


@pytest.mark.parametrize("text", [
    "/dev/shm", "/proc/self/status", "/sys/fs/cgroup/memory.max", "/usr/bin/env", "tokens/s", "a/b/c.yaml",
    "https://download.pytorch.org/whl/cpu", "outputs/${trainer.project_name}/run", "ratio 1/2", "../shared/data",
    "~/.cache/huggingface", "builtin:tiny-arith", "Qwen/Qwen2.5-0.5B", "1 / 3",
])
def test_guard_allows_system_and_relative_paths(text):
    assert not foreign_paths(text)
