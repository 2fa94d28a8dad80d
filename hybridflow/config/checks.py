"""The semantic checks of a loaded config: each ``*_problems`` function takes ``get(dotted_path) -> value`` (or
the values it needs) and returns the problems it finds as one-line strings (empty: none). They are run by
:func:`hybridflow.config.loader.load_config` after the merge, so all problems are reported together."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.utils.tracking import BACKEND_PACKAGES as LOGGER_PACKAGES
from hybridflow.utils.tracking import BACKENDS as LOGGER_BACKENDS

from hybridflow.config.megatron_checks import DEFAULT_STRATEGY, megatron_problems

# the keys that choose a role's training engine from hybridflow.training.ENGINES
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "critic.strategy", "reward_model.strategy",
                 "cost_model.strategy")


def _registry(kind: str) -> Any:
    """The registry ``kind`` (``"adv_estimator"``, ``"policy_loss"`` or ``"rollout"``), its built-in entries
    registered (imported on first use: the estimators and losses import torch)."""
    if kind == "rollout":
        from hybridflow.rollout import ROLLOUTS  # importing the package registers the built-in backends

        return ROLLOUTS
    from hybridflow.algorithms import ADV_ESTIMATORS, POLICY_LOSSES

    return {"adv_estimator": ADV_ESTIMATORS, "policy_loss": POLICY_LOSSES}[kind]


def declared(kind: str, name: Any, key: str, default: Any = None) -> Any:
    """Metadata ``key`` of entry ``name`` of the registry ``kind`` (see :func:`_registry`); ``default`` for a name no
    registry knows (that is reported by the name check of the loader). Raises nothing."""
    return _registry(kind).declared(name, key, default)


def choice_problems(path: str, value: str, allowed: Sequence[str]) -> list[str]:
    if value in allowed:
        return []
    if str(value) in ("True", "False"):  # YAML / the command line turned true, false, yes, no ... into a bool
        return [f"{path}: takes one of {', '.join(allowed)}, got the true/false value {str(value).lower()}"]
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return [f"{path}: {value!r} is not one of {', '.join(allowed)}{hint}"]


def batch_problems(get: Callable[[str], Any], role: str) -> list[str]:
    """Batch-size arithmetic of the PPO update of ``role`` (``actor_rollout_ref.actor`` or ``critic``).

    ``data.train_batch_size`` prompts are split into mini-batches of ``ppo_mini_batch_size`` prompts; each
    mini-batch holds ``ppo_mini_batch_size * rollout.n`` sequences, split evenly over the
    ``n_gpus_per_node * nnodes`` ranks and on each rank into micro-batches of ``ppo_micro_batch_size_per_gpu``
    (with ``use_dynamic_bsz``: of a token budget, so the micro-batch size need not divide anything).
    """
    train_batch, n = get("data.train_batch_size"), get("actor_rollout_ref.rollout.n")
    n_gpus, nnodes = get("trainer.n_gpus_per_node"), get("trainer.nnodes")
    mini, micro = get(f"{role}.ppo_mini_batch_size"), get(f"{role}.ppo_micro_batch_size_per_gpu")
    if min(train_batch, n, n_gpus, nnodes, mini, micro) < 1:
        return []  # reported by the value rules
    world = n_gpus * nnodes
    problems = []
    if train_batch % mini:
        problems.append(f"data.train_batch_size ({train_batch}) must be divisible by "
                        f"{role}.ppo_mini_batch_size ({mini})")
    sequences = mini * n
    if sequences % world:
        problems.append(f"{role}.ppo_mini_batch_size * actor_rollout_ref.rollout.n = {mini} * {n} = {sequences} "
                        f"sequences must be divisible by the {world} ranks "
                        f"(trainer.n_gpus_per_node * trainer.nnodes = {n_gpus} * {nnodes})")
    elif not get(f"{role}.use_dynamic_bsz") and (sequences // world) % micro:  # token budgets: micro unused
        problems.append(f"{role}.ppo_micro_batch_size_per_gpu ({micro}) must divide the per-rank mini-batch "
                        f"of {sequences // world} sequences "
                        f"(ppo_mini_batch_size * rollout.n / ranks = {mini} * {n} / {world})")
    return problems


def parallel_layout_problems(get: Callable[[str], Any]) -> list[str]:
    """The actor's training layout (dp x tp) and generation layout (dp_g x tp_g) on the actor's ranks: both tp
    sizes divide the ranks, and one divides the other (the 3D-HybridEngine's micro data-parallel grouping)."""
    tp, tp_g = (get(f"actor_rollout_ref.{r}.tensor_model_parallel_size") for r in ("actor", "rollout"))
    if min(tp, tp_g) < 1:
        return []  # reported by the value rules
    pools, mapping = get("resource_pool.pools"), get("resource_pool.mapping")
    pool = mapping.get("actor", "global_pool") if mapping else "global_pool"
    if pools and pool in pools:
        world, where = sum(pools[pool]), f"the {sum(pools[pool])} ranks of resource pool {pool!r}"
    else:
        world = get("trainer.n_gpus_per_node") * get("trainer.nnodes")
        where = f"the {world} actor ranks (trainer.n_gpus_per_node * trainer.nnodes)"
    problems = [f"actor_rollout_ref.{r}.tensor_model_parallel_size ({size}) must divide {where}"
                for r, size in (("actor", tp), ("rollout", tp_g)) if world % size]
    if tp % tp_g and tp_g % tp:
        problems.append(f"actor_rollout_ref.actor.tensor_model_parallel_size ({tp}) and "
                        f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp_g}) must divide one another")
    return problems


def trained_model_problems(get: Callable[[str], Any]) -> list[str]:
    """Settings of a trained model (the actor; the critic when one is trained) that would only fail or go wrong
    after the workers start: ``dtype=float16`` (pure fp16 weights and AdamW states with no loss scaling: the
    quickstart's policy collapsed within two steps; auto computes in bf16 over fp32 master weights where bf16
    pays). The engine's own settings are checked by its registration (fsdp2: ``reshard_after_forward=false`` with
    LoRA adapters, :mod:`hybridflow.training.fsdp2_config`)."""
    from hybridflow.algorithms import need_critic_for

    models = ["actor_rollout_ref.model"]
    if need_critic_for(get("critic.enable"), get("algorithm.adv_estimator")):
        models.append("critic.model")
    problems = []
    for model in models:
        if str(get(f"{model}.dtype")).lower() in ("float16", "fp16"):
            problems.append(f"{model}.dtype=float16: hybridflow does not train in fp16 (no loss scaling); use "
                            "auto (bf16 compute over fp32 master weights where bf16 pays), bfloat16 or float32")
    return problems


def driver_problems(get: Callable[[str], Any]) -> list[str]:
    """``algorithm.driver`` names a registered driver (:mod:`hybridflow.trainer.driver`); an estimator that one
    driver owns (registry metadata ``owns_estimators``: ReMax's greedy baseline) runs under it; every optional
    feature switched on (``FEATURES``) is one the driver implements (metadata ``features``); the driver's own
    checks (``Driver.config_problems``). Each driver's own keys are checked by its registration's ``config_checks``."""
    from hybridflow.trainer.driver import DRIVERS, FEATURES, driver_names, drivers_with

    driver, estimator = get("algorithm.driver"), get("algorithm.adv_estimator")
    problems = choice_problems("algorithm.driver", driver, driver_names())
    if problems:
        return problems
    for owner in driver_names():
        reason = DRIVERS.meta(owner, "owns_estimators", {}).get(estimator)
        if reason and owner != driver:
            problems.append(f"algorithm.adv_estimator={estimator} needs algorithm.driver={owner} ({reason}), got "
                            f"algorithm.driver={driver}")
    problems.extend(DRIVERS.get(driver).config_problems(get))
    for feature, (key, what) in FEATURES.items():
        if get(key) and feature not in DRIVERS.meta(driver, "features", ()):
            which = drivers_with(feature)
            by = f"the {which[0]} driver" if len(which) == 1 else f"the drivers {' and '.join(which)}"
            problems.append(f"{key}=true{what} is supported by {by}, got algorithm.driver={driver}")
    if get("algorithm.bypass_old_log_prob") and (get("actor_rollout_ref.actor.tis_imp_ratio_cap") or -1) > 0:
        problems.append("algorithm.bypass_old_log_prob=true makes old_log_probs the rollout's logprobs, so "
                        "actor.tis_imp_ratio_cap would weight every token by 1: turn one of them off")
    return problems


def dapo_problems(get: Callable[[str], Any]) -> list[str]:
    """DAPO's pieces (which drivers run them: :func:`driver_problems`): dynamic sampling needs groups
    (rollout.n >= 2); the overlong buffer fits the response."""
    problems = []
    if get("algorithm.filter_groups.enable") and get("actor_rollout_ref.rollout.n") < 2:
        problems.append("algorithm.filter_groups.enable=true needs groups: set actor_rollout_ref.rollout.n >= 2 "
                        f"(got {get('actor_rollout_ref.rollout.n')}; a group of one is never informative)")
    buffer = "reward_model.overlong_buffer"
    if get(f"{buffer}.enable"):
        length, max_len = get(f"{buffer}.len"), get("data.max_response_length")
        if not 1 <= length <= max_len:
            problems.append(f"{buffer}.len must be in [1, data.max_response_length={max_len}] when "
                            f"{buffer}.enable=true, got {length}")
    return problems


def mismatch_problems(get: Callable[[str], Any]) -> list[str]:
    """The rollout/trainer mismatch corrections (:mod:`hybridflow.algorithms.rollout_correction`, IcePop): ordered
    bands; truncated IS not on top of a loss that weights by the mismatch ratio itself; and none of them with
    ``bypass_old_log_prob`` (pi_old is then mu, every ratio 1: nothing would be weighted or masked)."""
    actor = "actor_rollout_ref.actor"
    problems = []
    level, upper, lower = get(f"{actor}.rollout_rs"), get(f"{actor}.rollout_rs_threshold"), \
        get(f"{actor}.rollout_rs_threshold_lower")
    if level is not None and upper is not None and upper > 0 and lower is not None and lower > upper:
        problems.append(f"{actor}.rollout_rs_threshold_lower ({lower}) must be <= {actor}.rollout_rs_threshold "
                        f"({upper})")
    loss, tis = get(f"{actor}.policy_loss"), (get(f"{actor}.tis_imp_ratio_cap") or -1) > 0
    own_band = declared("policy_loss", loss, "masked_tokens") is not None
    if tis and declared("policy_loss", loss, "own_mismatch_weight"):
        problems.append(f"{actor}.policy_loss={loss} already weights each token by pi_old/mu; "
                        f"{actor}.tis_imp_ratio_cap would weight it twice: set it to -1")
    if get("algorithm.bypass_old_log_prob") and (level is not None or own_band):
        what = f"{actor}.rollout_rs={level}" if level is not None else f"{actor}.policy_loss={loss}"
        problems.append(f"algorithm.bypass_old_log_prob=true makes old_log_probs the rollout's logprobs, so {what} "
                        "would see pi_old/mu = 1 on every token and mask nothing: turn one of them off")
    return problems


def strategy_problems(get: Callable[[str], Any]) -> list[str]:
    """Each ``*.strategy`` must name a registered training engine (:data:`hybridflow.training.ENGINES`; a user
    engine registers from a plugin module). Each engine's own keys are checked by its registration's
    ``config_checks``."""
    names = {key: get(key) for key in STRATEGY_KEYS}
    if all(name == DEFAULT_STRATEGY for name in names.values()):
        return megatron_problems(get)
    from hybridflow.training import ENGINES

    known = ENGINES.names()
    problems = []
    for key, name in names.items():
        if name not in ENGINES:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{key}: {name!r} is not implemented; registered training engines: "
                            f"{', '.join(known)}{hint}; a new one registers with "
                            "hybridflow.training.register_engine")
    return problems + megatron_problems(get)


def reward_fn_problems(get: Callable[[str], Any]) -> list[str]:
    """A user ``reward_model.compute_score`` must import and name a callable (loaded here once, on the driver)."""
    spec = get("reward_model.compute_score")
    if spec == "default":
        return []
    from hybridflow.rewards import load_compute_score

    try:
        load_compute_score(spec)
    except ValueError as exc:
        return [str(exc)]
    return []


def score_model_problems(get: Callable[[str], Any]) -> list[str]:
    return [f"{role}.enable=true needs {role}.model.path (a local sequence- or token-classification checkpoint)"
            for role in ("reward_model", "cost_model") if get(f"{role}.enable") and not get(f"{role}.model.path")]


def logger_problems(loggers: Sequence[str]) -> list[str]:
    problems = []
    for name in loggers:
        if name not in LOGGER_BACKENDS:
            problems += choice_problems("trainer.logger", name, LOGGER_BACKENDS)
        elif name in LOGGER_PACKAGES and importlib.util.find_spec(LOGGER_PACKAGES[name]) is None:
            problems.append(f"trainer.logger: the {name} backend needs the {LOGGER_PACKAGES[name]} package "
                            f'(pip install -e ".[{name}]" or pip install {LOGGER_PACKAGES[name]})')
    return problems


def rollout_package_problems(get: Callable[[str], Any]) -> list[str]:
    """A rollout backend that declares ``requires_package`` (vllm) needs that package installed; the message gives
    the backend's ``install_hint`` for ``trainer.device`` and the backends that need no extra package."""
    name = get("actor_rollout_ref.rollout.name")
    package = declared("rollout", name, "requires_package")
    if package is None or importlib.util.find_spec(package) is not None:
        return []
    hints = declared("rollout", name, "install_hint") or {}
    hint = hints.get(get("trainer.device"), hints.get(None, f"pip install {package}"))
    others = " | ".join(_names("rollout", requires_package=None))
    return [f"actor_rollout_ref.rollout.name: {name!r} is not installed ({hint}), "
            f"or use actor_rollout_ref.rollout.name={others}"]


vllm_problems = rollout_package_problems  # the former name


def _names(kind: str, **where: Any) -> list[str]:
    """Names of the registry ``kind`` (see :func:`_registry`) whose metadata has the values ``where``."""
    return _registry(kind).names(**where)


def lora_rollout_problems(get: Callable[[str], Any]) -> list[str]:
    """With the actor's ``lora_rank`` > 0: what the chosen rollout backend declares it takes (a colocated backend
    generates from a merged copy per rank, adapters with ``lora_sync=adapter``, a largest adapter rank). The checks of
    the ``lora_*`` keys themselves are :func:`hybridflow.models.lora.lora_problems`."""
    model, rank = "actor_rollout_ref.model", get("actor_rollout_ref.model.lora_rank")
    if (rank or 0) <= 0:
        return []
    problems = []
    rollout, sync = get("actor_rollout_ref.rollout.name"), get("actor_rollout_ref.rollout.lora_sync")
    colocated = declared("rollout", rollout, "uses_hybrid_engine", False)  # with LoRA: its own merged copy per rank
    if colocated and get("actor_rollout_ref.rollout.tensor_model_parallel_size") > 1:
        problems.append(f"{model}.lora_rank > 0 with the hf rollout generates from a full merged copy per rank: "
                        "set actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    takes_adapters = declared("rollout", rollout, "lora_adapter_sync", False)  # the backend loads peft adapters
    if sync == "adapter" and not takes_adapters:
        problems.append(f"actor_rollout_ref.rollout.lora_sync=adapter needs a rollout that takes LoRA adapters "
                        f"({' | '.join(_names('rollout', lora_adapter_sync=True))}), got rollout.name={rollout}: "
                        "use lora_sync=merged")
    max_rank = declared("rollout", rollout, "max_lora_rank")
    if sync == "adapter" and max_rank is not None and rank > max_rank:
        problems.append(f"{model}.lora_rank={rank} with lora_sync=adapter and the {rollout} rollout: it takes ranks "
                        f"up to {max_rank}; use lora_sync=merged or a smaller rank")
    return problems
