"""Sphinx extension: writes the pages that are generated from the code, before Sphinx reads the sources.

* ``reference/config.md``: every key of the assembled schema (:func:`hybridflow.config.assemble.assembled_schema`:
  :class:`hybridflow.config.schema.HybridFlowConfig` and the config dataclasses of the registry entries) with its
  type, default, the comment that documents it where its dataclass is written, the values it accepts where the loader fixes
  them (``hybridflow.config.loader.CHOICES``) and verl's name where it differs (:data:`VERL_NAMES`).
* ``reference/cli.md``: ``hybridflow --help`` and every subcommand's ``--help``, from ``hybridflow.cli.build_parser``.

Both files are git-ignored and rewritten on every build (only when their text changed, so an incremental build
stays incremental). ``tests/test_docs.py`` imports :func:`config_keys` and :func:`render_config_reference`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import os
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Iterator

DOCS = Path(__file__).resolve().parents[1]
SCHEMA = DOCS.parent / "hybridflow" / "config" / "schema.py"

#: keys whose verl counterpart has another name or another meaning (from the schema's comments and the
#: README's list of differences); every other key either has verl's name or has no verl counterpart
VERL_NAMES: dict[str, str] = {
    "actor_rollout_ref.actor.tensor_model_parallel_size":
        "verl keeps the training tp under `actor_rollout_ref.actor.megatron.tensor_model_parallel_size`",
    "reward_model.compute_score": "`custom_reward_function.path` and `custom_reward_function.name`",
    "trainer.n_gpus_per_node": "same name; counts ranks per node (on CPU a rank is a process)",
    "data.train_files": "same name; `null` (the default) means the built-in task",
    "data.val_files": "same name; `null` (the default) means the built-in task",
    "resource_pool.pools": "no verl key: which roles share devices is config here",
    "resource_pool.mapping": "no verl key: which roles share devices is config here",
}


def _comments(path: Path = SCHEMA) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """``({(class name, field name): doc}, {class name: doc})`` from the schema's comments.

    A field's doc is the comment lines right above it, then its trailing comment. The comment block that opens a
    class body documents the class (the page's section text); it also documents the first field when that field
    has no trailing comment of its own.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    fields: dict[tuple[str, str], str] = {}
    classes: dict[str, str] = {}
    for node in ast.parse("\n".join(lines)).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for n, stmt in enumerate(node.body):
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            above, i = [], stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            line = lines[stmt.end_lineno - 1]
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            if n == 0 and above:
                classes[node.name] = " ".join(above)
                above = [] if trailing else above
            fields[(node.name, stmt.target.id)] = " ".join(_sentence(part) for part in (" ".join(above), trailing)
                                                          if part)
    return fields, classes


@functools.cache
def _file_comments(path: str) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    return _comments(Path(path))


def _origin(cls: type, name: str) -> type:
    """The dataclass whose source declares field ``name`` of the (assembled) section class ``cls``."""
    from hybridflow.config.assemble import field_origin

    return field_origin(cls, name)


def _static(cls: type) -> type:
    """The first class in ``cls``'s MRO that has a source file (an assembled class has none)."""
    from hybridflow.config.assemble import central_class

    return central_class(cls)


def _field_doc(owner: type, name: str) -> tuple[str, str]:
    """``(comment, annotation as written)`` of field ``name`` of the section class ``owner``, from the source of
    the dataclass that declares it (the central schema or a registry entry's config)."""
    origin = _origin(owner, name)
    field_docs, _ = _file_comments(inspect.getsourcefile(origin))
    written = next(f.type for f in dataclasses.fields(origin) if f.name == name)
    return field_docs.get((origin.__name__, name), ""), str(written)


def _class_doc(cls: type) -> str:
    static = _static(cls)
    return _file_comments(inspect.getsourcefile(static))[1].get(static.__name__, "")


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field, Any]]:
    """``(dotted key, owning dataclass instance, field, value)`` for every field, sections before their keys."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        yield key, obj, f, value
        if dataclasses.is_dataclass(value):
            yield from _walk(value, key + ".")


def config_keys() -> list[str]:
    """Every leaf key of the schema (sections left out), dotted, in schema order."""
    from hybridflow.config.assemble import assembled_schema

    return [key for key, _, _, value in _walk(assembled_schema()()) if not dataclasses.is_dataclass(value)]


def _cell(text: str) -> str:
    """Text on one line (one item of a list-table row)."""
    return text.replace("\n", " ")


def _yaml(value: Any) -> str:
    """A default as it is written in a recipe (YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _key_html(key: str) -> str:
    """A dotted key as inline HTML code that may wrap after each dot (a long key stays readable in a narrow
    column); :func:`page_keys` reads the keys back."""
    return '<code class="docutils literal">' + ".<wbr>".join(key.split(".")) + "</code>"


def page_keys(markdown: str) -> set[str]:
    """The keys listed in a rendered config reference (the first cell of each table row)."""
    keys = set()
    for line in markdown.splitlines():
        if line.startswith('* - <code class="docutils literal">'):
            keys.add(line.removeprefix('* - <code class="docutils literal">').removesuffix("</code>")
                     .replace("<wbr>", ""))
    return keys


def _sentence(text: str) -> str:
    text = text.strip()
    return text if not text or text[-1] in ".)?!" else text + "."


def _meaning(key: str, doc: str, choices: dict[str, tuple[str, ...]]) -> str:
    meaning = _sentence(doc) or "(no comment in the schema)"
    if key in choices:
        accepted = dict.fromkeys(v.lower() for v in choices[key])
        meaning += " Accepted: " + ", ".join(f"`{c}`" for c in accepted) + "."
    if key in VERL_NAMES:
        meaning += f" verl: {VERL_NAMES[key]}."
    return meaning


def render_config_reference() -> str:
    """The Markdown text of ``reference/config.md``: one table per section of the schema."""
    from hybridflow.config.assemble import assembled_schema
    from hybridflow.config.loader import CHOICES

    out = ["# Config reference", "",
           "Generated at build time from `hybridflow/config/schema.py` and the config dataclasses the registry "
           "entries declare (a policy loss's, a driver's, a rollout backend's own keys; the comment on each "
           "field) and the loader's fixed value sets, so it lists exactly the keys `hybridflow train` accepts. "
           "Set a key in a recipe YAML or as `key=value` on the command line; `hybridflow train RECIPE "
           "--print-config` prints the resolved config. A key with no verl note has verl's name, or has no verl "
           "counterpart. Batch sizes: `data.train_batch_size` and `*.ppo_mini_batch_size` count prompts, "
           "`*micro_batch_size_per_gpu` counts sequences on one rank.", ""]
    sections: dict[str, tuple[str, list[str]]] = {}  # section key -> (its text, its rows)
    for key, owner, f, value in _walk(assembled_schema()()):
        doc, written = _field_doc(type(owner), f.name)
        if dataclasses.is_dataclass(value):
            text = " ".join(_sentence(t) for t in (doc, _class_doc(type(value))) if t)
            sections[key] = (text, [])
            continue
        section = key.rsplit(".", 1)[0]
        sections[section][1].append(f"* - {_key_html(key)}\n  - `{_cell(written)}`\n  - `{_cell(_yaml(value))}`\n"
                                    f"  - {_cell(_meaning(key, doc, CHOICES))}")
    for section, (text, rows) in sections.items():
        out += ["", f"## `{section}`", ""] + ([_cell(text), ""] if text else [])
        if rows:
            out += ["```{list-table}", ":header-rows: 1", ":widths: 30 15 13 42", ":class: config-reference", "",
                    "* - key\n  - type\n  - default\n  - meaning", *rows, "```"]
        else:
            subsections = [s for s in sections if s.startswith(section + ".") and s.count(".") == section.count(".") + 1]
            out += ["Sections: " + ", ".join(f"`{s}`" for s in subsections) + "."]
    return "\n".join(out) + "\n"


def render_cli_reference() -> str:
    """The Markdown text of ``reference/cli.md``: the help of ``hybridflow`` and of each subcommand."""
    from hybridflow.cli import COMMANDS, build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal width: fix it for the page
    try:
        parser = build_parser()
        subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        out = ["# Command line", "", "Generated at build time from `hybridflow/cli.py`'s argument parsers.", "",
               "```text", "$ hybridflow --help", _help(parser), "```"]
        for name in COMMANDS:
            out += ["", f"## `hybridflow {name}`", "", "```text", f"$ hybridflow {name} --help",
                    _help(subparsers.choices[name]), "```"]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(out) + "\n"


def _help(parser: Any) -> str:
    """What ``parser.print_help()`` prints."""
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        parser.print_help()
    return buffer.getvalue().rstrip()


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it holds that text already (keeps incremental builds incremental)."""
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def write_pages(app: Any = None, config: Any = None) -> None:
    """Write the generated pages into the source tree (Sphinx's ``config-inited`` event)."""
    _write_if_changed(DOCS / "reference" / "config.md", render_config_reference())
    _write_if_changed(DOCS / "reference" / "cli.md", render_cli_reference())


def setup(app: Any) -> dict[str, Any]:
    """Sphinx entry point."""
    app.connect("config-inited", write_pages)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
