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

``tiny-moe``: a 0.86M-parameter Qwen3-MoE-architecture model (the tiny-arith trunk and tokenizer; every MLP a mixture of
8 experts of 48 hidden units, top-2), sparse-upcycled from tiny-arith and SFT-trained briefly on the same mixture: the
starting point of ``recipes/moe_grpo_quickstart.yaml``. Rebuild it with
``python scripts/build_tiny_moe.py --out hybridflow/assets/tiny-moe``.

``tiny-vlm``: a 0.85M-parameter Qwen2.5-VL-architecture model (a one-block vision tower of width 64 with 14-pixel
patches and 2 x 2 merge, 0.22M parameters; a 3-layer text model of hidden 128 with heads of dim 32) with a byte-level
BPE tokenizer carrying Qwen's vision tokens, SFT-trained on the circle-counting task (``hybridflow.data.vlm_task``)
to answer the right count about a third of the time when sampled and mostly one too many otherwise: the starting point of
``recipes/vlm_grpo_quickstart.yaml``. Its directory holds the image processor (``preprocessor_config.json``) and
the tokenizer separately (load both with ``hybridflow.models.vlm_build.load_vlm_processor``). Rebuild it with
``python scripts/build_tiny_vlm.py --out hybridflow/assets/tiny-vlm``.

A Hugging Face hub id (``Qwen/Qwen2.5-0.5B-Instruct``: ``org/name`` that is no local path) resolves to its snapshot
in the Hugging Face cache (:func:`resolve_hub_id`), downloaded when missing unless ``HF_HUB_OFFLINE`` is set.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Optional

from hybridflow.errors import UserError

BUILTIN_PREFIX = "builtin:"
_ASSETS = Path(__file__).resolve().parents[2] / "assets"
BUILTIN_MODELS: dict[str, str] = {"tiny-arith": str(_ASSETS / "tiny-arith"), "tiny-tool": str(_ASSETS / "tiny-tool"),
                                  "tiny-moe": str(_ASSETS / "tiny-moe"),  # scripts/build_tiny_moe.py
                                  "tiny-vlm": str(_ASSETS / "tiny-vlm")}  # scripts/build_tiny_vlm.py
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# files no transformers loader reads: the original (non-HF) checkpoints some repositories carry next to the HF ones
HUB_IGNORE_PATTERNS = ("original/*", "*.pth")
_TRUE = ("1", "true", "yes", "on")


class HubModelError(UserError, FileNotFoundError):
    """A hub id that does not resolve to a local snapshot (offline and not cached, unknown on the hub, gated, the
    hub unreachable); ``str(error)`` is one line. Also a ``FileNotFoundError``, as a missing local directory."""


def is_hub_id(path: str) -> bool:
    """Whether ``path`` reads as a Hugging Face hub id (``org/name``) and names no existing local file or folder."""
    return bool(_HUB_ID.fullmatch(path)) and not os.path.exists(path)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read now: ``huggingface_hub`` reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Optional[str]:
    """The hub cache that ``HF_HUB_CACHE`` (or ``HF_HOME``/hub) names now, None for the library's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None


def resolve_model_path(path: str) -> str:
    """Map ``"builtin:NAME"`` to the shipped directory of NAME and a hub id to its local snapshot
    (:func:`resolve_hub_id`); return any other string (a local path) unchanged.

    Raises:
        ValueError: NAME is not a known built-in model (the message lists the known names).
        HubModelError: (a ``FileNotFoundError``) a hub id that cannot be had locally (one line).
    """
    if is_hub_id(path):
        return resolve_hub_id(path)
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


def resolve_hub_id(repo_id: str) -> str:
    """The local snapshot directory of the hub model ``repo_id`` (its ``main`` revision) in the hub cache
    (:func:`hub_cache_dir`): downloaded by ``huggingface_hub.snapshot_download`` when missing or outdated, without
    the files of :data:`HUB_IGNORE_PATTERNS`; with ``HF_HUB_OFFLINE`` set, the cached snapshot only, nothing is
    fetched. A snapshot found once is remembered for the process (workers resolve it again, from the cache).

    Raises:
        HubModelError: offline (or the hub unreachable) and not cached; the hub has no such model, or it is gated
            or private without a token: one line naming the id, the cache and what to do.
    """
    return _snapshot(repo_id, hub_offline(), hub_cache_dir())


@functools.lru_cache(maxsize=None)
def _snapshot(repo_id: str, offline: bool, cache_dir: Optional[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"model path {repo_id!r} is not a local directory, so it was taken as a Hugging Face hub id"
    try:
        return snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=offline,
                                 ignore_patterns=list(HUB_IGNORE_PATTERNS))
    except LocalEntryNotFoundError as exc:
        cache = cache_dir or "the default Hugging Face cache"
        if offline:
            raise HubModelError(f"{where}, but it is not in the hub cache ({cache}) and HF_HUB_OFFLINE=1 allows no "
                                "download: download it once online (unset HF_HUB_OFFLINE) or pass a local model "
                                "directory") from None
        cause = exc.__cause__ or exc
        raise HubModelError(f"{where}, but the hub cannot be reached ({_one_line(cause)}) and it is not in the hub "
                            f"cache ({cache}): pass a local model directory") from None
    except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, HfHubHTTPError, HFValidationError, OSError
        raise HubModelError(f"{where}, but it cannot be downloaded ({_one_line(exc)}): check the id (and a token "
                            "for a gated or private model: HF_TOKEN), or pass a local model directory") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
