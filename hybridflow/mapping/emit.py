"""Turn a plan into a config snippet that ``hybridflow train RECIPE`` accepts (merge it into a recipe, or pass
it as the recipe's delta): the cluster shape, the workload the plan was made for, the resource pools, the
role-to-pool mapping and the chosen layouts.

hybridflow runs the reference policy inside the actor's process (``ActorRolloutRefWorker``), so the snippet
maps the reference with the actor whatever the plan says (a comment notes a plan that put it elsewhere); roles
the driver of the planned algorithm has no worker for (the driver registry's roles) are reported in comments only.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from hybridflow.mapping.search import Plan, pack_sets
from hybridflow.mapping.specs import ClusterSpec, SpecError, Workload

__all__ = ["plan_to_config", "plan_to_yaml", "write_config"]

#: algorithm.adv_estimator of the algorithms whose dataflow the plan assumed (Safe-RLHF has its own driver)
ADV_ESTIMATORS = {"ppo": "gae", "grpo": "grpo", "remax": "remax"}


def _pool_name(roles: tuple[str, ...]) -> str:
    return "_".join(roles)


def _map_driver_roles(plan: Plan, roles: list[str], algorithm: str, mapping: dict[str, str],
                      notes: list[str]) -> str | None:
    """Map the planned cost model and cost critic to their pools when the driver that runs ``algorithm`` (the
    driver registry's ``planned_as``) has those roles, else note them; returns that driver (None: none)."""
    from hybridflow.trainer.driver import driver_for_plan, get_driver

    driver = driver_for_plan(algorithm)
    driver_roles = get_driver(driver).ROLES if driver else ()
    for role, config_role in (("cost", "cost_model"), ("cost_critic", "cost_critic")):
        if role in roles and config_role in driver_roles:
            mapping[config_role] = _pool_name(plan.set_of(role).roles)
        elif role in roles:
            notes.append(f"{role}: planned on pool {_pool_name(plan.set_of(role).roles)}; no driver for "
                         f"{algorithm} has a {config_role} worker, so it is not mapped")
    return driver


def plan_to_config(plan: Plan, cluster: ClusterSpec, workload: Workload) -> tuple[dict, list[str]]:
    """The config delta of ``plan`` and the comment lines that explain what it could not express.

    Raises:
        SpecError: the workload's batch does not split into ``ppo_updates`` mini-batches of whole prompts, or
            the sets do not pack onto the cluster's nodes.
    """
    if workload.batch % workload.ppo_updates:
        raise SpecError(f"batch {workload.batch} prompts do not split into {workload.ppo_updates} mini-batches "
                        "(ppo_updates) of whole prompts, which actor.ppo_mini_batch_size needs")
    pools_per_set = pack_sets(plan.allocation, cluster)
    if pools_per_set is None:
        raise SpecError(f"sets of {list(plan.allocation)} devices do not pack onto {cluster}")
    notes: list[str] = []
    roles = [r for s in plan.placement for r in s]
    actor_set = plan.set_of("actor")
    mapping = {"actor": _pool_name(actor_set.roles)}
    if "critic" in roles:
        mapping["critic"] = _pool_name(plan.set_of("critic").roles)
    else:  # no critic worker runs, but the driver checks that every config role names a pool
        mapping["critic"] = mapping["actor"]
    if "reward" in roles:
        mapping["reward"] = _pool_name(plan.set_of("reward").roles)
    else:
        mapping["reward"] = mapping["actor"]
        notes.append("reward: rule-based (no model), so it runs on the actor's pool")
    if "reference" in roles and "reference" not in actor_set.roles:
        notes.append(f"reference: planned on pool {_pool_name(plan.set_of('reference').roles)}, but hybridflow runs "
                     "it inside the actor's process (ActorRolloutRefWorker), so it runs on the actor's pool")
    driver = _map_driver_roles(plan, roles, workload.algorithm, mapping, notes)
    used = set(mapping.values())
    pools = {}
    for est, per_node in zip(plan.sets, pools_per_set):
        name = _pool_name(est.roles)
        if name in used:
            pools[name] = per_node
        else:
            notes.append(f"pool {name} ({est.devices} devices) holds no role the config can place; left out")

    layouts: dict[str, dict[str, list[int]]] = {}
    for est in plan.sets:
        for ph in est.phases:
            if ph.kind in ("train", "generate") or (ph.kind == "infer" and ph.role in ("reference", "reward")):
                layouts.setdefault(ph.role, {})[ph.kind] = ph.layout.as_list()
    layouts = {r: v for r, v in layouts.items() if r in ("actor", "critic", "reference", "reward")}
    if "reference" in layouts and "reference" not in actor_set.roles:
        del layouts["reference"]  # planned for other devices than the actor's pool it will run on

    world = cluster.n_devices
    mini = workload.batch // workload.ppo_updates
    per_rank = mini * workload.n / world
    micro = workload.micro_batch
    if per_rank == int(per_rank):
        micro = math.gcd(micro, int(per_rank))
    else:
        notes.append(f"ppo mini-batch of {mini * workload.n} sequences does not split over {world} ranks: "
                     "the config loader will ask for another batch size")
    for role in ("actor", "critic") if "critic" in roles else ("actor",):
        pool_ranks = sum(pools.get(mapping[role], [])) or world
        if (mini * workload.n) % pool_ranks:
            notes.append(f"{role}: a mini-batch of {mini * workload.n} sequences does not split evenly over the "
                         f"{pool_ranks} ranks of its pool")
    has_critic = "critic" in roles
    config = {
        "trainer": {"nnodes": cluster.nodes, "n_gpus_per_node": cluster.devices_per_node,
                    "device": "cpu" if cluster.device.name == "cpu" else "cuda"},
        "data": {"train_batch_size": workload.batch, "max_prompt_length": workload.prompt_len,
                 "max_response_length": workload.response_len},
        "actor_rollout_ref": {"actor": {"ppo_epochs": workload.ppo_epochs, "ppo_mini_batch_size": mini,
                                        "ppo_micro_batch_size_per_gpu": micro},
                              "rollout": {"n": workload.n}},
        "critic": ({"enable": True, "ppo_epochs": workload.ppo_epochs, "ppo_mini_batch_size": mini,
                    "ppo_micro_batch_size_per_gpu": micro} if has_critic else {"enable": False}),
        "resource_pool": {"pools": pools, "mapping": mapping},
        "layouts": layouts,
    }
    if workload.algorithm in ADV_ESTIMATORS:
        config["algorithm"] = {"adv_estimator": ADV_ESTIMATORS[workload.algorithm]}
    else:
        notes.append(f"algorithm: planned for {workload.algorithm}; choose its estimator yourself")
    if driver is not None:
        config.setdefault("algorithm", {})["driver"] = driver
    return config, notes


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, flow-style lists (``[pp, tp, dp]`` and per-node rank counts on one line)."""


_Dumper.add_representer(list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data,
                                                                              flow_style=True))


def plan_to_yaml(plan: Plan, cluster: ClusterSpec, workload: Workload) -> str:
    """``plan_to_config`` as YAML text led by comments (the plan, its estimate, and the notes)."""
    config, notes = plan_to_config(plan, cluster, workload)
    stages = ", ".join(f"{k} {v:.3g} s" for k, v in plan.stage_seconds.items())
    head = [f"hybridflow plan: {workload.algorithm} on {cluster} ({cluster.n_devices} devices)",
            f"placement: {plan.describe()}",
            f"estimated iteration: {plan.seconds:.4g} s ({stages})",
            "layouts are [pp, tp, dp] per role and phase (informational until the workers read them)",
            *notes]
    body = yaml.dump(config, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    return "".join(f"# {line}\n" for line in head) + body


def write_config(path: str | Path, plan: Plan, cluster: ClusterSpec, workload: Workload) -> str:
    """Write ``plan_to_yaml`` to ``path`` and return the text."""
    text = plan_to_yaml(plan, cluster, workload)
    Path(path).write_text(text)
    return text
