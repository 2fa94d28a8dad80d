"""Load a recipe and ``key=value`` overrides into the typed schema, and validate everything once.

``load_config`` imports the modules of ``trainer.plugins`` (as the recipe and overrides set it), builds
``OmegaConf.structured`` of the schema assembled from the central sections and every registry entry's config
(:mod:`hybridflow.config.assemble`), merges the YAML recipe (a plain delta on the
schema defaults) and then the overrides (OmegaConf dotlist syntax: ``data.train_batch_size=64``,
``trainer.logger=[console]``), resolves interpolations such as ``${trainer.project_name}``, runs the semantic
checks below (with every registry entry's own ``config_checks``) and returns a read-only ``DictConfig``. Every problem found (unknown keys with the nearest valid
key, wrong types, unresolvable interpolations, bad values and batch-size arithmetic) is collected and raised
together as one ``ConfigError``.

Loading never imports Ray, so a bad config fails in seconds, before Ray starts. Names that live in registries
or name tables (``NAME_SOURCES``: advantage estimator, policy loss, loss aggregation, KL estimator, rollout
backend, rule cost) are checked by importing ``hybridflow.algorithms`` / ``hybridflow.rollout`` /
``hybridflow.rewards.cost``, only for values that differ from the schema defaults. The modules of
``trainer.plugins`` are imported first, so names they register and keys their entries declare pass. ``algorithm.driver`` and what each driver
needs are checked against the driver registry (:mod:`hybridflow.trainer.driver`; its modules import no Ray).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import ipaddress
import os
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.config.sp_checks import sequence_parallel_problems
from hybridflow.config.checks import (batch_problems, choice_problems, dapo_problems, driver_problems,
                                      logger_problems, mismatch_problems,
                                      parallel_layout_problems, reward_fn_problems, rollout_package_problems,
                                      score_model_problems, strategy_problems, trained_model_problems)
from hybridflow.config.assemble import assembled_schema, entry_checks
from hybridflow.config.layouts import apply_layouts
from hybridflow.registry import Registry
from hybridflow.config.checks import lora_rollout_problems  # the rollout's side of lora_problems
from hybridflow.config.moe_checks import router_replay_problems
from hybridflow.models.lora import lora_problems
from hybridflow.tools.config import multi_turn_problems
from hybridflow.utils.provenance import RUN_INFO_KEY

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"  # YAML recipes shipped in the package

CHOICES: dict[str, tuple[str, ...]] = {  # keys whose value must be one of a fixed set
    "reward_model.combine": ("sum", "model"),
    "reward_model.model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "cost_model.model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "data.truncation": ("error", "left", "right", "filter"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.nonfinite_grad": ("skip", "error"),
    "actor_rollout_ref.model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "critic.model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": ("constant", "cosine"),
    "critic.optim.lr_scheduler_type": ("constant", "cosine"),
    "algorithm.recompute_old_log_prob": ("auto", "always"),
    "actor_rollout_ref.actor.router_replay": ("off", "rollout", "recompute"),
    # a YAML / command-line bool arrives in the str field as True / False
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": ("auto", "true", "false", "True", "False"),
    "critic.fsdp_config.reshard_after_forward": ("auto", "true", "false", "True", "False"),
}
# keys that were accepted once and removed: setting one is an unknown key, with this hint
REMOVED_KEYS: dict[str, str] = {
    "reward_model.reward_manager": "hybridflow has one reward manager (verl's naive: each response's score on its "
                                   "last token); a custom scoring function goes in reward_model.compute_score",
}
NAME_SOURCES: dict[str, tuple[str, str]] = {  # key -> (module, attribute): a registry lookup or the accepted names
    "algorithm.adv_estimator": ("hybridflow.algorithms", "get_adv_estimator_fn"),
    "actor_rollout_ref.actor.policy_loss": ("hybridflow.algorithms", "get_policy_loss_fn"),
    "actor_rollout_ref.actor.loss_agg_mode": ("hybridflow.algorithms", "LOSS_AGG_MODES"),
    "critic.loss_agg_mode": ("hybridflow.algorithms", "LOSS_AGG_MODES"),
    "actor_rollout_ref.actor.kl_loss_type": ("hybridflow.algorithms", "KL_PENALTY_TYPES"),
    "algorithm.kl_penalty": ("hybridflow.algorithms", "KL_PENALTY_TYPES"),
    "actor_rollout_ref.rollout.name": ("hybridflow.rollout", "get_rollout_class"),
    "actor_rollout_ref.rollout.multi_turn.format": ("hybridflow.tools", "get_tool_format"),
    "cost_model.rule": ("hybridflow.rewards.cost", "get_cost_fn"),
    "algorithm.kl_ctrl.type": ("hybridflow.algorithms.kl", "KL_CONTROLLERS"),
}

_POSITIVE = (  # counts that must be >= 1
    "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
    "data.builtin_train_size", "data.builtin_val_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.micro_batch_size_per_gpu", "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.tensor_model_parallel_size", "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu",
    "critic.ppo_epochs", "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_epochs",
    "reward_model.micro_batch_size_per_gpu", "cost_model.micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu",
)
_POSITIVE_OR_NONE = ("actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn", "data.val_batch_size",
                     "trainer.total_training_steps", "trainer.ray_init.num_cpus")
_POSITIVE_OR_DISABLED = ("trainer.save_freq", "trainer.test_freq")
_FRACTIONS = (  # values in [0, 1]
    "algorithm.gamma", "algorithm.lam",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "actor_rollout_ref.actor.optim.min_lr_ratio",
    "critic.optim.lr_warmup_steps_ratio", "critic.optim.min_lr_ratio",
)
_PROBABILITIES = ("actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.val_kwargs.top_p")  # in (0, 1]

def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


_VALUE_RULES: list[tuple[Sequence[str], Callable[[Any], bool], str]] = [
    (_POSITIVE, lambda v: v >= 1, "must be >= 1"),
    (_POSITIVE_OR_NONE, lambda v: v is None or v >= 1, "must be null or >= 1"),
    (_POSITIVE_OR_DISABLED, lambda v: v == -1 or v >= 1, "must be -1 (disabled) or >= 1"),
    (("data.train_max_samples", "data.val_max_samples"), lambda v: v == -1 or v >= 1, "must be -1 (all rows) or >= 1"),
    (_FRACTIONS, lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    (_PROBABILITIES, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    (("actor_rollout_ref.actor.optim.lr", "critic.optim.lr"), lambda v: v > 0, "must be > 0"),
    (("reward_model.timeout_s", "trainer.call_timeout_s"), lambda v: v is None or v > 0, "must be null or > 0"),
    (("actor_rollout_ref.actor.clip_ratio", "critic.cliprange_value"), lambda v: v > 0, "must be > 0"),
    (("actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high"),
     lambda v: v is None or v > 0, "must be null or > 0"),
    (("actor_rollout_ref.actor.clip_ratio_c",), lambda v: v > 1, "must be > 1 (dual-clip constant)"),
    (("actor_rollout_ref.actor.tis_level",), lambda v: v in ("token", "sequence"), "must be token or sequence"),
    (("actor_rollout_ref.actor.rollout_rs",), lambda v: v is None or v in ("token", "sequence", "geometric"),
     "must be null (off), token, sequence or geometric"),
    (("actor_rollout_ref.actor.rollout_rs_threshold",), lambda v: v is None or v > 0, "must be null or > 0"),
    (("actor_rollout_ref.actor.rollout_rs_threshold_lower",),
     lambda v: v is None or v >= 0, "must be >= 0"),
    (("reward_model.overlong_buffer.penalty_factor",), lambda v: v >= 0,
     "must be >= 0"),
    (("actor_rollout_ref.actor.loss_scale_factor",), lambda v: v is None or v > 0, "must be null or > 0"),
    (("actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.val_kwargs.temperature"),
     lambda v: v >= 0, "must be >= 0"),
    (("actor_rollout_ref.rollout.top_k", "actor_rollout_ref.rollout.val_kwargs.top_k"),
     lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1"),
    (("trainer.ray_init.node_ip_address",), _is_ip, "must be an IP address of this machine (127.0.0.1: local only)"),
]


class ConfigError(ValueError):
    """One or more problems in a recipe or its overrides; ``problems`` lists them, each led by its dotted key."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        noun = "problem" if len(self.problems) == 1 else "problems"
        lines = [f"invalid config ({len(self.problems)} {noun}):"] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def available_recipes() -> list[str]:
    """Names of the recipes shipped in ``hybridflow/recipes`` (file stems, sorted)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str | Path) -> Path:
    """Path of a recipe given as a YAML path or as the bare name of a shipped recipe (``quickstart``).

    Raises:
        ConfigError: neither an existing file nor a shipped recipe; the message lists the shipped ones.
    """
    path = Path(recipe)
    if path.is_file():
        return path
    if len(path.parts) == 1 and path.suffix in ("", ".yaml", ".yml"):
        shipped = RECIPES_DIR / f"{path.stem}.yaml"
        if shipped.is_file():
            return shipped
    hint = " (the recipe comes first; key=value overrides follow it)" if "=" in str(recipe) else ""
    raise ConfigError([f"recipe {str(recipe)!r} not found: no such file and no shipped recipe of that name{hint}; "
                       f"shipped recipes: {', '.join(available_recipes()) or '(none)'}"])


def load_config(recipe: str | Path | None = None, overrides: Iterable[str] = ()) -> DictConfig:
    """Schema defaults, then the recipe, then the overrides; validated, resolved and read-only.

    Args:
        recipe: a YAML file path, the bare name of a shipped recipe, or None for the schema defaults.
        overrides: ``key=value`` strings in OmegaConf dotlist syntax, applied in order after the recipe.

    Returns:
        A struct-mode, read-only ``DictConfig`` of the assembled schema (:func:`assembled_schema`) with all
        interpolations resolved.

    Raises:
        ConfigError: listing every problem found, each with its dotted key.
        UserError: a module of ``trainer.plugins`` cannot be imported (raised before the other checks run).
    """
    problems: list[str] = []
    deltas = _read_deltas(recipe, overrides, problems)
    plugins = _plugins_named(deltas)
    if plugins:  # before the schema is built: a plugin's registry entries bring their keys and checks
        plugins = _import_plugins(plugins)
    schema = assembled_schema()
    all_paths, _, leaf_paths = _schema_info(schema)
    cfg = OmegaConf.structured(schema)
    bad_paths: set[str] = set()  # keys whose value was rejected: semantic checks that read them are skipped
    for delta, source in deltas:
        if isinstance(delta, ConfigError):
            problems.extend(delta.problems)
        else:
            _merge(cfg, delta, schema, "", source, problems, bad_paths, all_paths)
    for path in leaf_paths:
        if path in bad_paths:
            continue
        try:
            _get(cfg, path)
        except OmegaConfBaseException as exc:
            problems.append(f"{path}: {str(exc).splitlines()[0]}")
            bad_paths.add(path)
    if plugins and "trainer.plugins" not in bad_paths:
        cfg.trainer.plugins = plugins  # file paths made absolute, so every worker finds them
    if not problems:  # the layouts section decides the tp keys the semantic checks read
        problems.extend(apply_layouts(cfg, functools.partial(_get, cfg)))
    problems.extend(_semantic_problems(cfg, bad_paths, schema))
    if problems:
        raise ConfigError(problems)
    try:
        OmegaConf.resolve(cfg)  # values nested inside free-form (Any) keys
    except OmegaConfBaseException as exc:
        raise ConfigError([f"{getattr(exc, 'full_key', None) or '<root>'}: {str(exc).splitlines()[0]}"]) from None
    _make_paths_absolute(cfg)
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _read_deltas(recipe: str | Path | None, overrides: Iterable[str],
                 problems: list[str]) -> list[tuple[Any, str]]:
    """The recipe and each override as ``(plain nested dict, source)``, in merge order; one that cannot be read is
    a ``(ConfigError, source)`` in its place (its problems are reported in that order); a recipe that is not
    found goes to ``problems`` at once."""
    deltas: list[tuple[Any, str]] = []
    if recipe is not None:
        try:
            path = resolve_recipe(recipe)
            deltas.append((_read_recipe(path), f"recipe {path.name}"))
        except ConfigError as exc:
            problems.extend(exc.problems)
    for item in overrides:
        try:
            deltas.append((_parse_override(item), "override"))
        except ConfigError as exc:
            deltas.append((exc, "override"))
    return deltas


def _plugins_named(deltas: list[tuple[Any, str]]) -> list[str]:
    """``trainer.plugins`` as the deltas set it (the last one that does wins, as in the merge); [] when none does
    or the value is not a list of strings (the merge reports a wrong type)."""
    plugins: list[str] = []
    for delta, _ in deltas:
        trainer = delta.get("trainer") if isinstance(delta, dict) else None
        if isinstance(trainer, dict) and "plugins" in trainer:
            value = trainer["plugins"]
            plugins = list(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else []
    return plugins


def _import_plugins(plugins: list[str]) -> list[str]:
    """Import ``trainer.plugins``; returns the entries with file paths made absolute.

    Raises:
        UserError: a plugin cannot be imported (one line naming it), before anything else is checked.
    """
    from hybridflow.plugins import import_plugins, resolve_plugins

    resolved = resolve_plugins(plugins)
    import_plugins(resolved)
    return resolved


def _make_paths_absolute(cfg: DictConfig) -> None:
    """Resolve the run's paths against the working directory once, at load: the run directory
    ``trainer.default_local_dir`` (``~`` expanded), an explicit ``trainer.resume_mode`` checkpoint path and a user
    reward file in ``reward_model.compute_score``. Every
    later reader (driver, workers on other nodes, the log) then sees the same absolute path; under
    ``ray job submit --working-dir`` a relative one lands in Ray's temporary copy of the working directory."""
    trainer = cfg.trainer
    trainer.default_local_dir = os.path.abspath(os.path.expanduser(trainer.default_local_dir))
    if trainer.resume_mode not in ("auto", "disable"):
        trainer.resume_mode = os.path.abspath(os.path.expanduser(trainer.resume_mode))
    if cfg.reward_model.compute_score != "default":
        from hybridflow.rewards import split_compute_score

        target, name, is_file = split_compute_score(cfg.reward_model.compute_score)
        if is_file:  # a user file: every worker imports it by this path
            cfg.reward_model.compute_score = f"{os.path.abspath(os.path.expanduser(target))}:{name}"


def config_to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain nested dict of a config with interpolations resolved (for saving or logging)."""
    return OmegaConf.to_container(cfg, resolve=True)


def need_critic(cfg: DictConfig) -> bool:
    """Whether the run trains a critic: ``critic.enable`` when set, else whether the estimator reads critic values
    (:func:`hybridflow.algorithms.need_critic_for`, which the trainer calls with the two values)."""
    from hybridflow.algorithms import need_critic_for

    return need_critic_for(cfg.critic.enable, cfg.algorithm.adv_estimator)


# ---------------------------------------------------------------------------------------------- schema walk


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _schema_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the schema (sections and leaves) -> its annotation."""
    out: dict[str, Any] = {}
    for name, hint in _type_hints(cls).items():
        path = f"{prefix}{name}"
        out[path] = hint
        if dataclasses.is_dataclass(hint):
            out.update(_schema_paths(hint, f"{path}."))
    return out


@functools.cache
def _schema_info(schema: type) -> tuple[dict[str, Any], DictConfig, list[str]]:
    """``(every dotted key -> annotation, the read-only defaults, the leaf keys)`` of an assembled schema."""
    all_paths = _schema_paths(schema)
    defaults = OmegaConf.structured(schema, flags={"readonly": True})
    return all_paths, defaults, [p for p, hint in all_paths.items() if not dataclasses.is_dataclass(hint)]


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in rest) + " or null"
    if typing.get_origin(hint) in (list, typing.List):
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(hint, "__name__", str(hint))


def _get(cfg: DictConfig, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = node[part]
    return node


def _read_recipe(path: Path) -> dict:
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise ConfigError([f"recipe {path}: not valid YAML: {' '.join(str(exc).split())}"]) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError([f"recipe {path}: the top level must be a mapping of config sections"])
    recipe = OmegaConf.to_container(loaded, resolve=False)
    recipe.pop(RUN_INFO_KEY, None)  # a run's saved config.yaml: what produced that run, not config
    return recipe


def _parse_override(item: str) -> dict:
    key = item.split("=", 1)[0]
    if "=" not in item or not key:
        raise ConfigError([f"override {item!r}: expected key=value (e.g. data.train_batch_size=64)"])
    if key[0] in "+~":
        raise ConfigError([f"override {item!r}: Hydra-style '{key[0]}' prefixes are not supported; "
                           "every key already exists in the schema, set it with key=value"])
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError([f"{key}: cannot parse override {item!r}: {' '.join(str(exc).split())}"]) from None


def _merge(cfg: DictConfig, delta: dict, cls: type, prefix: str, source: str,
           problems: list[str], bad_paths: set[str], all_paths: dict[str, Any]) -> None:
    """Apply ``delta`` (a plain nested dict) onto the section ``prefix`` of ``cfg``, whose dataclass is ``cls``.

    Unknown keys and values of the wrong type are appended to ``problems`` (and their paths to ``bad_paths``)
    and skipped; everything else is applied.
    """
    hints = _type_hints(cls)
    for key, value in delta.items():
        path = f"{prefix}{key}"
        if key not in hints:
            problems.append(_unknown_key_problem(path, str(key), list(hints), source, all_paths))
            bad_paths.add(path)
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if value is None:  # an empty section in YAML (`critic:` with all its keys commented out)
                continue
            if isinstance(value, dict):
                _merge(cfg, value, hint, f"{path}.", source, problems, bad_paths, all_paths)
            else:
                problems.append(f"{path}: expected a section (a mapping of its keys), got {value!r} (from {source})")
                bad_paths.add(path)
            continue
        try:
            OmegaConf.update(cfg, path, value, merge=False)
        except OmegaConfBaseException:
            problems.append(f"{path}: expected {_type_name(hint)}, got {value!r} (from {source})")
            bad_paths.add(path)


def _ratio(a: str, b: str) -> float:
    """Similarity of two key names in [0, 1]; a name contained in the other counts as close."""
    if min(len(a), len(b)) >= 4 and (a in b or b in a):
        return max(0.85, difflib.SequenceMatcher(None, a, b).ratio())
    return difflib.SequenceMatcher(None, a, b).ratio()


def _unknown_key_problem(path: str, key: str, siblings: list[str], source: str, all_paths: dict[str, Any]) -> str:
    prefix = path[: len(path) - len(key)]
    message = f"{path}: unknown key (from {source})"
    if path in REMOVED_KEYS:
        return message + f"; removed: {REMOVED_KEYS[path]}"
    if key == "defaults":
        return message + "; recipes are plain deltas on the schema defaults, without a defaults list"
    suggestions = []
    sibling = max(siblings, key=lambda s: _ratio(key, s))
    sibling_score = _ratio(key, sibling)
    if sibling_score >= 0.6:
        suggestions.append(prefix + sibling)
    if sibling_score < 0.8:  # a poor local match: the key may sit in another section
        best = max(all_paths, key=lambda p: (_ratio(key, p.rsplit(".", 1)[-1]), _ratio(path, p)))
        if _ratio(key, best.rsplit(".", 1)[-1]) >= 0.6 and best not in suggestions:
            suggestions.append(best)
    if suggestions:
        return message + "; did you mean " + " or ".join(suggestions) + "?"
    where = f"under {prefix[:-1]}" if prefix else "at the top level"
    return message + f"; valid keys {where}: {', '.join(siblings)}"


# ------------------------------------------------------------------------------------------ semantic checks


class _Skip(Exception):
    """A value a check needs was already reported as invalid."""


def _semantic_problems(cfg: DictConfig, bad_paths: set[str], schema: type) -> list[str]:
    def get(path: str) -> Any:
        if path in bad_paths:
            raise _Skip
        return _get(cfg, path)

    checks: list[Callable[[], list[str]]] = []
    for paths, predicate, requirement in _VALUE_RULES:
        checks += [lambda p=p, ok=predicate, req=requirement: [] if ok(get(p)) else [f"{p}: {req}, got {get(p)}"]
                   for p in paths]
    checks += [lambda p=p, allowed=allowed: choice_problems(p, get(p), allowed) for p, allowed in CHOICES.items()]
    defaults = _schema_info(schema)[1]
    checks += [lambda p=p: _name_problems(get, p, defaults) for p in NAME_SOURCES]
    checks += [lambda fn=fn: fn(get) for _, fn in entry_checks()]  # each registry entry's checks of its own keys

    def critic_batch_problems() -> list[str]:
        from hybridflow.algorithms import need_critic_for

        trained = need_critic_for(get("critic.enable"), get("algorithm.adv_estimator"))
        return batch_problems(get, "critic") if trained else []

    checks += [lambda: batch_problems(get, "actor_rollout_ref.actor"), critic_batch_problems,
               lambda: logger_problems(get("trainer.logger")), lambda: rollout_package_problems(get),
               lambda: driver_problems(get), lambda: dapo_problems(get), lambda: score_model_problems(get),
               lambda: reward_fn_problems(get), lambda: strategy_problems(get),
               lambda: parallel_layout_problems(get), lambda: lora_problems(get) + lora_rollout_problems(get),
               lambda: multi_turn_problems(get),
               lambda: trained_model_problems(get), lambda: mismatch_problems(get),
               lambda: sequence_parallel_problems(get), lambda: router_replay_problems(get)]
    problems: list[str] = []
    for check in checks:
        try:
            problems.extend(check())
        except _Skip:
            pass
    return problems


def _name_problems(get: Callable[[str], Any], path: str, defaults: DictConfig) -> list[str]:
    """Check the value of ``path`` against its registry or name table in ``NAME_SOURCES``.

    A value equal to the schema default is not looked up: the package registers its defaults itself (a test
    checks this), and skipping them keeps the common load from importing the rollout backends (transformers).
    A module that cannot be imported (an installation without that part, or a missing optional dependency)
    skips the check here; the trainer then reports a bad name when it looks it up.
    """
    name = get(path)
    if name == _get(defaults, path):
        return []  # a backend's missing package (vllm) is reported by rollout_package_problems
    module, attribute = NAME_SOURCES[path]
    try:
        source = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return []
    if isinstance(source, Registry):  # its names are the choices (one message for every fixed set)
        source = tuple(source.names())
    if not callable(source):
        return choice_problems(path, name, source)
    try:
        source(name)
    except (KeyError, ValueError, NotImplementedError) as exc:
        return [f"{path}: {exc.args[0] if exc.args else exc}"]
    return []
