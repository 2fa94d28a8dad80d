"""Every leaf key of the schema is read by the package (outside the config loader), so no documented key is
silently ignored.

How "read" is decided, statically: every attribute chain in the package's sources (``self.config.critic.
fsdp_config.param_offload``), with local aliases expanded (``cfg = self.config.critic`` then ``cfg.optim.lr``
reads ``critic.optim.lr``), and every dotted string (``get("trainer.device")``). A chain reads key ``K`` when it
ends with at least the last two components of ``K`` and, where it names more, those agree with ``K``: a chain
whose earlier component is another schema section (``...actor.fsdp_config.param_offload``) does not read
``critic.fsdp_config.param_offload``, while one rooted at a function argument reads every key it could stand
for; a single component after the root counts only on a config-named root (``optim_config.lr``,
``cfg.ppo_epochs``; not ``tensor.device`` or ``gsm8k.compute_score``). ``config/schema.py``, ``config/loader.py`` and ``config/checks.py`` do not count: validation is not use.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

import hybridflow
from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.config.assemble import assembled_schema

PACKAGE = Path(hybridflow.__file__).resolve().parent
NOT_USE = {PACKAGE / "config" / "schema.py", PACKAGE / "config" / "loader.py", PACKAGE / "config" / "checks.py"}

# Keys read only dynamically or not yet applied by design, each checked by hand (keep this list short):
EXEMPT = {
    # read by name in hybridflow/config/layouts.py (get(f"layouts.{role}") for each role of PHASES), applied at load
    # (tests/config/test_layouts_section.py)
    "layouts.actor", "layouts.critic", "layouts.reference", "layouts.reward",
    # read by name in hybridflow/algorithms/advantage.py (getattr(config, pname) for each estimator parameter)
    "algorithm.gamma", "algorithm.lam", "algorithm.norm_adv_by_std_in_grpo",
    # read as self.config[self.role].micro_batch_size_per_gpu / section.strategy in hybridflow/workers/rm_worker.py
    "reward_model.micro_batch_size_per_gpu", "cost_model.micro_batch_size_per_gpu",
    "reward_model.strategy", "cost_model.strategy",
    # validation only, by design (hybridflow/config/sp_checks.py): the reference runs on the actor's layout (its sp
    # is 1 or the actor's), and Megatron context parallelism is refused at load (it needs TransformerEngine)
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size", "actor_rollout_ref.actor.megatron.context_parallel_size",
    "actor_rollout_ref.ref.megatron.context_parallel_size", "critic.megatron.context_parallel_size",
    # read by hybridflow.algorithms.need_critic_for (given critic.enable by config/checks.py and the trainer's roles)
    "critic.enable",
}


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out += _leaf_keys(hint, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def _sections(cls: type) -> set[str]:
    out = set()
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out |= {name} | _sections(hint)
    return out


LEAVES = _leaf_keys(assembled_schema())  # the central keys and every registry entry's (aipo_rho, vLLM's engine keys)
SECTIONS = _sections(assembled_schema())


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> [a, b, c]; ``getattr(a.b, "c", ...)`` counts as ``a.b.c``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        base = _chain(node.args[0])
        return base + [node.args[1].value] if base else None
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _chains_of(tree: ast.AST) -> list[list[str]]:
    """Attribute chains of one scope with aliases (``name = chain``) expanded, plus dotted strings."""
    aliases: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value)
            if chain and len(chain) > 1:
                aliases[node.targets[0].id] = chain
    chains = []
    for node in ast.walk(tree):
        is_getattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
        if is_getattr or isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent", None),
                                                                           ast.Attribute):
            chain = _chain(node)
            for _ in range(5):  # expand aliases of aliases
                if chain and chain[0] in aliases and aliases[chain[0]][0] != chain[0]:
                    chain = aliases[chain[0]] + chain[1:]
            if chain:
                chains.append(chain)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            if all(part.isidentifier() for part in node.value.split(".")):
                chains.append(node.value.split("."))
    return chains


def _package_chains() -> list[list[str]]:
    chains = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in NOT_USE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child._parent = node
        scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] or [tree]
        for scope in scopes + [tree]:
            chains += _chains_of(scope)
    return chains


def reads(chain: list[str], key: str) -> bool:
    """Whether ``chain`` reads ``key`` (see the module docstring)."""
    parts = key.split(".")
    common = 0
    while common < min(len(chain), len(parts)) and chain[-1 - common] == parts[-1 - common]:
        common += 1
    if common == len(parts):
        return True
    if common == 0 or common == len(chain):
        return False
    before = chain[-1 - common]
    if before in SECTIONS:  # names another section: ...actor.fsdp_config.param_offload is not the critic's
        return False
    return common >= 2 or "cfg" in before.lower() or "config" in before.lower()


def unread_keys() -> list[str]:
    chains = _package_chains()
    return [key for key in LEAVES if key not in EXEMPT and not any(reads(c, key) for c in chains)]


def test_every_schema_key_is_read_by_the_package():
    assert not unread_keys(), "schema keys read nowhere in the package (implement or remove them)"


def test_exemptions_are_schema_keys():
    assert EXEMPT <= set(LEAVES)


@pytest.mark.parametrize("chain, key, expected", [
    ("self.config.critic.fsdp_config.param_offload", "critic.fsdp_config.param_offload", True),
    ("cfg.actor.fsdp_config.param_offload", "critic.fsdp_config.param_offload", False),
    ("fsdp.param_offload", "critic.fsdp_config.param_offload", False),
    ("optim_config.lr_warmup_steps", "critic.optim.lr_warmup_steps", True),
    ("gsm8k.compute_score", "reward_model.compute_score", False),
    ("optim_config.optim.lr_warmup_steps", "critic.optim.lr_warmup_steps", True),
    ("tensor.device", "trainer.device", False),
    ("self.config.trainer.device", "trainer.device", True),
])
def test_reads_rule(chain, key, expected):
    assert reads(chain.split("."), key) is expected


@pytest.mark.parametrize("override", ["reward_model.reward_manager=naive"])
def test_removed_keys_are_unknown_with_a_hint(override):
    with pytest.raises(ConfigError, match="unknown key"):
        load_config("quickstart", [override])
