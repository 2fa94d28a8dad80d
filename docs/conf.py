"""Sphinx configuration of the hybridflow documentation (build: ``sphinx-build -W -b html docs docs/_build/html``).

Pages are MyST Markdown. Two pages are generated at build time, so they cannot drift from the code:
``reference/config.md`` from ``hybridflow/config/schema.py`` and ``reference/cli.md`` from the command line's
argument parsers (``docs/_ext/generated_reference.py``; both files are git-ignored).
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the package itself, also when it is not installed
sys.path.insert(0, str(DOCS / "_ext"))

project = "hybridflow"
author = "hybridflow developers"
copyright = "hybridflow developers"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "generated_reference",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "screenshot.py"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links are checked by the build
suppress_warnings = []

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = ["vllm", "megatron", "peft"]  # optional extras: the API pages build without them
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "hybridflow"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {"navigation_with_keys": True}
