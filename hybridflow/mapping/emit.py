"""Turn a plan into a config that ``hybridflow train`` runs as it is (or merge it into a recipe): the cluster
shape, the workload the plan was made for, the resource pools, the role-to-pool mapping and the chosen layouts
(``layouts``, applied at load by ``hybridflow.config.layouts``).

Only plans that ``train`` can run are emitted: every layout and placement must be within the registered engine's
abilities (``hybridflow.mapping.abilities``; ``hybridflow plan`` searches within them), and the config names that
engine (the actor's and the critic's ``strategy``). Plan roles map to the
config's worker roles: actor -> ``actor`` (its process also runs the reference), critic -> ``critic``, reward
model -> ``reward_model``, cost -> ``cost_model``, cost critic -> ``cost_critic``; every pool holds at least one of
them, so every device the plan counts is used.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from hybridflow.mapping.abilities import ENGINE_ABILITIES, Abilities
from hybridflow.mapping.flows import dataflow_of
from hybridflow.mapping.sequence_parallel import SP_CONFIG_KEYS
from hybridflow.mapping.layouts import PHASES as LAYOUT_PHASES  # layouts written per plan role
from hybridflow.mapping.search import Plan, pack_sets
from hybridflow.mapping.specs import MODEL_PRESETS, ClusterSpec, ModelSpec, SpecError, Workload
from hybridflow.training import ENGINES

__all__ = ["plan_problems", "plan_to_config", "plan_to_yaml", "write_config"]

#: plan role -> the config's worker role (resource_pool.mapping key); the reference runs in the actor's process
CONFIG_ROLES = {"actor": "actor", "critic": "critic", "reward": "reward_model", "cost": "cost_model",
                "cost_critic": "cost_critic"}
#: the model preset shipped with hybridflow, by its mapper name
SHIPPED = {"tiny-arith": "builtin:tiny-arith"}


def _pool_name(roles: tuple[str, ...]) -> str:
    return "_".join(roles)


def plan_problems(plan: Plan, abilities: Abilities) -> list[str]:
    """Why ``plan`` cannot run on a system with ``abilities`` (empty: it can): a placement or a layout beyond them,
    or a reference whose layout differs from the actor's training layout while it runs in the actor's process."""
    problems = []
    reason = abilities.placement_reason(plan.placement)
    if reason:
        problems.append(reason)
    for est in plan.sets:
        for ph in est.phases:
            reason = abilities.layout_reason(ph.role, ph.layout, ph.kind in ("generate", "reshard"))
            if reason:
                problems.append(f"{ph.role} {ph.kind} {ph.layout}: {reason}")
    if abilities.reference_with_actor and "reference" in plan.set_of("actor").roles:
        train = next(m.layout for m in plan.set_of("actor").memory if m.role == "actor")
        ref = next(m.layout for m in plan.set_of("reference").memory if m.role == "reference")
        if ref != train:
            problems.append(f"reference {ref} differs from the actor's training layout {train}, on which it runs")
    return problems


def _pools_and_mapping(plan: Plan, cluster: ClusterSpec) -> tuple[dict[str, list[int]], dict[str, str]]:
    """``resource_pool.pools`` (one per set) and ``resource_pool.mapping`` (config role -> pool)."""
    per_set = pack_sets(plan.allocation, cluster)
    if per_set is None:
        raise SpecError(f"sets of {list(plan.allocation)} devices do not pack onto {cluster}")
    pools = {_pool_name(est.roles): per_node for est, per_node in zip(plan.sets, per_set)}
    actor_pool = _pool_name(plan.set_of("actor").roles)
    # the rule reward runs with the actor; the driver checks that every config role names a pool
    mapping = {"actor": actor_pool, "critic": actor_pool, "reward": actor_pool}
    for est in plan.sets:
        for role in est.roles:
            if role in CONFIG_ROLES:
                mapping[CONFIG_ROLES[role]] = _pool_name(est.roles)
    return pools, mapping


def _layouts(plan: Plan) -> dict[str, dict[str, list[int]]]:
    """``layouts``: [pp, tp, dp] per role and phase (``LAYOUT_PHASES``)."""
    out: dict[str, dict[str, list[int]]] = {}
    for est in plan.sets:
        for ph in est.phases:
            if ph.kind in LAYOUT_PHASES.get(ph.role, ()):
                out.setdefault(ph.role, {})[ph.kind] = ph.layout.as_list()
    return out


def _micro_batch(workload: Workload, cluster: ClusterSpec, pools: dict, mapping: dict, notes: list[str]) -> int:
    """The per-rank micro-batch: the workload's, cut to divide a mini-batch's share of each rank (notes otherwise)."""
    world, mini = cluster.n_devices, workload.batch // workload.ppo_updates
    per_rank = mini * workload.n / world
    micro = workload.micro_batch
    if per_rank == int(per_rank):
        micro = math.gcd(micro, int(per_rank))
    else:
        notes.append(f"ppo mini-batch of {mini * workload.n} sequences does not split over {world} ranks: "
                     "the config loader will ask for another batch size")
    for role in ("actor", "critic"):
        ranks = sum(pools[mapping[role]])
        if (mini * workload.n) % ranks:
            notes.append(f"{role}: a mini-batch of {mini * workload.n} sequences does not split evenly over the "
                         f"{ranks} ranks of its pool")
    return micro


def _model_keys(plan: Plan, models: dict[str, ModelSpec] | None, config: dict, notes: list[str]) -> None:
    """Model paths the plan knows (a directory, or the shipped preset) and the reward/cost model switches."""
    def path(role: str) -> str | None:
        name = models[role].name if models and role in models else None
        return SHIPPED.get(name) if name in MODEL_PRESETS else name

    roles = {r for s in plan.placement for r in s}
    if path("actor"):
        config["actor_rollout_ref"]["model"] = {"path": path("actor")}
    if "critic" in roles and path("critic") and path("critic") != path("actor"):
        config["critic"]["model"] = {"path": path("critic")}
    for role, key in (("reward", "reward_model"), ("cost", "cost_model")):
        if role in roles:
            config[key] = {"enable": True, **({"model": {"path": path(role)}} if path(role) else {})}
            if not path(role):
                notes.append(f"{key}: planned for preset {models[role].name if models else '?'}; set "
                             f"{key}.model.path to its checkpoint")


def plan_to_config(plan: Plan, cluster: ClusterSpec, workload: Workload,
                   models: dict[str, ModelSpec] | None = None,
                   abilities: Abilities = ENGINE_ABILITIES["fsdp2"]) -> tuple[dict, list[str]]:
    """The config of ``plan`` and the comment lines that explain what it could not express. ``models``: the
    plan's models by role (their paths are written when known); ``abilities``: the training engine the plan was
    made for, written as the actor's and the critic's ``strategy``.

    Raises:
        SpecError: the plan is beyond ``abilities`` (``plan_problems``), the workload's batch does not split into
            ``ppo_updates`` mini-batches of whole prompts, or the sets do not pack onto the cluster's nodes.
    """
    problems = plan_problems(plan, abilities)
    if problems:
        raise SpecError(f"the plan cannot run on engine {abilities.name}: " + "; ".join(problems))
    if workload.batch % workload.ppo_updates:
        raise SpecError(f"batch {workload.batch} prompts do not split into {workload.ppo_updates} mini-batches "
                        "(ppo_updates) of whole prompts, which actor.ppo_mini_batch_size needs")
    notes: list[str] = []
    pools, mapping = _pools_and_mapping(plan, cluster)
    roles = {r for s in plan.placement for r in s}
    if "reward" not in roles:
        notes.append("reward: rule-based (no model), so it runs on the actor's pool")
    mini, micro = workload.batch // workload.ppo_updates, _micro_batch(workload, cluster, pools, mapping, notes)
    update = {"ppo_epochs": workload.ppo_epochs, "ppo_mini_batch_size": mini, "ppo_micro_batch_size_per_gpu": micro}
    config = {
        "trainer": {"nnodes": cluster.nodes, "n_gpus_per_node": cluster.devices_per_node,
                    "device": "cpu" if cluster.device.name == "cpu" else "cuda"},
        "data": {"train_batch_size": workload.batch, "max_prompt_length": workload.prompt_len,
                 "max_response_length": workload.response_len},
        "actor_rollout_ref": {"actor": {"strategy": abilities.name, **update}, "rollout": {"n": workload.n}},
        "critic": {"enable": True, "strategy": abilities.name, **update} if "critic" in roles else {"enable": False},
        "resource_pool": {"pools": pools, "mapping": mapping},
        "layouts": _layouts(plan),
    }
    for role, key in SP_CONFIG_KEYS.items():  # Ulysses sp of the roles the plan splits sequences for
        sp = max((ph.layout.sp for est in plan.sets for ph in est.phases if ph.role == role), default=1)
        if sp > 1:
            section, name = key.rsplit(".", 1)
            node = config
            for part in section.split("."):
                node = node.setdefault(part, {})
            node[name] = sp
    _expert_keys(plan, abilities, config, notes)
    _model_keys(plan, models, config, notes)
    config["algorithm"] = _algorithm_keys(workload.algorithm, notes)
    return config, notes


#: plan role -> the config section whose engine layout section holds its expert parallel size
EXPERT_SECTIONS = {"actor": ("actor_rollout_ref", "actor"), "critic": ("critic",)}


def _expert_keys(plan: Plan, abilities: Abilities, config: dict, notes: list[str]) -> None:
    """The ep of the actor's and the critic's training layouts, as ``expert_model_parallel_size`` of their engine's
    layout section (its registration's ``layout_section``: megatron); a note where the engine has none."""
    layout_section = ENGINES.declared(abilities.name, "layout_section")
    for role, path in EXPERT_SECTIONS.items():
        ep = max((ph.layout.ep for est in plan.sets for ph in est.phases if ph.role == role and ph.kind == "train"),
                 default=1)
        if ep == 1:
            continue
        if layout_section is None:
            notes.append(f"{role}: planned with ep={ep}, which engine {abilities.name} cannot set")
            continue
        node = config
        for part in (*path, layout_section):
            node = node.setdefault(part, {})
        node["expert_model_parallel_size"] = ep


def _algorithm_keys(algorithm: str, notes: list[str]) -> dict[str, str]:
    """``algorithm.driver`` and ``adv_estimator`` of a planned algorithm, as its registered dataflow declares them."""
    keys = {}
    flow = dataflow_of(algorithm)
    driver = flow.driver
    if driver is not None:
        keys["driver"] = driver
    estimator = flow.adv_estimator  # the planned dataflow's (None: the driver's own choice)
    if estimator is not None:
        keys["adv_estimator"] = estimator
    elif driver is None:
        notes.append(f"algorithm: planned for {algorithm}; choose its driver and estimator yourself")
    return keys


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, flow-style lists (``[pp, tp, dp]`` and per-node rank counts on one line)."""


_Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data,
                                                                              flow_style=True))


def plan_to_yaml(plan: Plan, cluster: ClusterSpec, workload: Workload,
                 models: dict[str, ModelSpec] | None = None,
                 abilities: Abilities = ENGINE_ABILITIES["fsdp2"]) -> str:
    """``plan_to_config`` as YAML text led by comments (the plan, its estimate, and the notes)."""
    config, notes = plan_to_config(plan, cluster, workload, models, abilities)
    stages = ", ".join(f"{k} {v:.3g} s" for k, v in plan.stage_seconds.items())
    head = [f"hybridflow plan: {workload.algorithm} on {cluster} ({cluster.n_devices} devices)",
            f"placement: {plan.describe()}",
            f"estimated iteration: {plan.seconds:.4g} s ({stages})",
            "layouts are [pp, tp, dp] per role and phase; train applies them (the training engine's tp and pp, the "
            "rollout's tp) and logs them",
            *notes]
    body = yaml.dump(config, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    return "".join(f"# {line}\n" for line in head) + body


def write_config(path: str | Path, plan: Plan, cluster: ClusterSpec, workload: Workload,
                 models: dict[str, ModelSpec] | None = None,
                 abilities: Abilities = ENGINE_ABILITIES["fsdp2"]) -> str:
    """Write ``plan_to_yaml`` (the plan made within ``abilities``) to ``path`` and return the text."""
    text = plan_to_yaml(plan, cluster, workload, models, abilities)
    Path(path).write_text(text)
    return text
