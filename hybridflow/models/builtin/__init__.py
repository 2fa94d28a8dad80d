"""Models shipped inside the package, addressed as ``"builtin:NAME"`` in configs.

``tiny-arith``: a 0.85M-parameter Llama (hidden 128, 4 layers, 4 query / 2 key-value heads of
dim 32, tied embeddings, fp32, vocab 512) with a 494-token byte-level BPE tokenizer, SFT-trained on
the built-in arithmetic task (``hybridflow.data.builtin_task``) so that greedy decoding usually
takes a wrong shortcut while sampling is often right: the starting point of the quickstart RL run.
Rebuild it with
``python scripts/build_tiny_arith.py --out hybridflow/assets/tiny-arith`` and check it with
``python scripts/check_tiny_arith.py`` (repository scripts; the package ships the asset only).

``tiny-tool``: the same architecture with its own tokenizer (every digit one token; the Hermes tool strings are
added tokens) and a chat template that renders ``tools=`` and ``tool`` messages, SFT-trained on the tool-use task
(``hybridflow.data.tool_task``) to call the ``calculator`` in ~30% of its sampled answers and to guess otherwise:
the starting point of ``recipes/tool_grpo_quickstart.yaml``. Rebuild it with the two stages in
``scripts/build_tiny_tool.py``'s docstring.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_PREFIX = "builtin:"
_ASSETS = Path(__file__).resolve().parents[2] / "assets"
BUILTIN_MODELS: dict[str, str] = {"tiny-arith": str(_ASSETS / "tiny-arith"), "tiny-tool": str(_ASSETS / "tiny-tool")}


def resolve_model_path(path: str) -> str:
    """Map ``"builtin:NAME"`` to the shipped directory of NAME; return any other string unchanged.

    Raises:
        ValueError: NAME is not a known built-in model (the message lists the known names).
    """
    if not path.startswith(BUILTIN_PREFIX):
        return path
    name = path[len(BUILTIN_PREFIX):]
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown built-in model {name!r} in {path!r}; known: "
            f"{[BUILTIN_PREFIX + known for known in sorted(BUILTIN_MODELS)]}"
        ) from None
