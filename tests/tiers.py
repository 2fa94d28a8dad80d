"""The suite's three tiers, assigned here and nowhere else, and the guard that keeps each test in its tier.

* ``unit``: in-process; no Ray, no spawned ranks, no Python child process.
* ``dist``: gloo ranks, Ray actors or a Python child process (a CLI call), but no training run.
* ``e2e``: a training run (``hybridflow train`` in a child process, ``run_ppo`` or a driver in-process, both go
  through ``TrainLoop.fit``).

``TIERS`` maps a test file (path under ``tests/``) or one test in it (``path::name``, the name without its
parameters) to its tier; the longest matching key wins and a test nothing names is ``unit``. ``tests/conftest.py``
marks every collected test with its tier (``-m unit``, ``-m "unit or dist"``, ``-m e2e``).

The guard (:func:`install`) wraps what moves a test up a tier: ``ray.init``, ``multiprocessing`` process starts
and Python child processes (dist), an in-process ``TrainLoop.fit`` (e2e). While a test or a fixture it uses runs,
doing what is above its tier fails at once with a line saying which key of ``TIERS`` to add; a later test that uses
a fixture whose set-up went above its tier fails too. A training run in a child process (``hybridflow train``, an
``examples/`` driver, ``pty.fork``) is seen as dist only: such tests are named e2e here by what they run. With
``HYBRIDFLOW_TIER_RECORD=FILE`` the guard only records what each test and fixture did, as JSON lines in FILE (to
build or audit ``TIERS``).
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import pty
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

LEVELS = ("unit", "dist", "e2e")

#: path under tests/ (or path::test name) -> tier; anything not named is unit
TIERS: dict[str, str] = {
    "algorithms/test_algorithm_registries.py::test_algorithms_layer_does_not_import_ray": "dist",
    "benchmarks/test_gpu_check.py": "dist",
    "benchmarks/test_script_errors.py": "dist",
    "benchmarks/test_script_errors.py::test_run_script_statuses": "unit",
    "benchmarks/test_step_profile.py::test_matmul_rate_counts_two_flops_per_multiply_add": "dist",
    "benchmarks/test_tp_collectives.py": "dist",
    "config/test_driver_config.py::test_async_with_stale_samples_and_no_correction_exits_2_before_ray": "dist",
    "config/test_registered_config.py::test_loading_a_config_imports_neither_ray_nor_transformers": "dist",
    "controller/test_call_timeout.py": "dist",
    "controller/test_colocated.py": "dist",
    "controller/test_controller_resource_pool.py": "dist",
    "controller/test_controller_units.py::test_future_chunks_lazily_and_materializes_in_registered_method": "dist",
    "controller/test_controller_units.py::test_future_split_by_rank_hands_out_the_outputs_only_when_they_are_the_chunks": "dist",
    "controller/test_controller_worker_group.py": "dist",
    "controller/test_submit_after.py": "dist",
    "controller/test_unread_calls.py::test_a_never_read_failed_call_raises_at_the_next_call": "dist",
    "controller/test_pool_order.py": "dist",
    "data/test_preprocess.py::test_real_gsm8k_location_follows_the_clone": "dist",
    "distributed/test_precision.py::test_ranks_agree_and_mixed_precision_keeps_fp32_master_weights": "dist",
    "distributed/test_rendezvous_bind.py": "dist",
    "distributed/test_replicate.py::test_gradients_are_averaged_over_the_ranks": "dist",
    "distributed/test_shm_comm.py": "dist",
    "distributed/test_weight_sync.py::test_one_sender_two_receivers_in_separate_processes": "dist",
    "engine/test_engine_e2e.py": "e2e",
    "engine/test_hybrid_engine.py": "dist",
    "engine/test_hybrid_engine.py::test_a_weight_in_another_dtype_is_refused_before_any_transfer": "unit",
    "engine/test_megatron_bf16_generation.py": "dist",
    "engine/test_megatron_hybrid_e2e.py": "e2e",
    "engine/test_megatron_moe_e2e.py": "e2e",
    "engine/test_reshard_3d.py::test_megatron_layout_groups_and_greedy_tokens": "dist",
    "engine/test_reshard_3d.py::test_megatron_layout_shards_are_exact_slices": "dist",
    "engine/test_reshard_3d.py::test_megatron_layout_switch_memory": "dist",
    "engine/test_reshard_3d.py::test_shards_breaking_the_stage_contract_are_refused": "dist",
    "examples/test_examples.py": "e2e",
    "mapping/test_plan_to_train_e2e.py": "e2e",
    "rollout/test_multi_turn_vllm.py": "dist",
    "rollout/test_vllm_moe.py": "dist",
    "rollout/test_vllm_rollout.py": "dist",
    "rollout/test_vllm_vlm.py::test_image_prompt_logprobs_equal_the_hf_forward": "dist",
    "rollout/test_vllm_vlm.py::test_reload_changes_image_prompt_logprobs_exactly_as_hf_weights_do": "dist",
    "rollout/test_vllm_rollout.py::test_quickstart_with_vllm_rollout_through_ray": "e2e",
    "test_cli.py::test_config_error_does_not_import_ray": "dist",
    "test_docs.py": "dist",
    "test_docs.py::test_config_reference_lists_every_schema_key_with_its_comment": "unit",
    "test_docs.py::test_install_pins_in_the_pages_are_the_readme_s": "unit",
    "test_docs.py::test_readme_stays_short_and_cites_no_missing_design_doc": "unit",
    "test_docs.py::test_relative_links_and_cited_paths_exist": "unit",
    "test_docs.py::test_troubleshooting_messages_are_the_code_s": "unit",
    "test_cli.py::test_config_error_exits_2_without_traceback": "dist",
    "test_cli.py::test_help_and_version_load_neither_torch_nor_ray": "dist",
    "test_cli.py::test_known_third_party_warnings_are_hidden_here_and_in_started_processes": "dist",
    "test_cli_user_errors.py::test_data_errors_through_the_cli_are_one_line_without_traceback": "dist",
    "trainer/test_algorithms_e2e.py": "e2e",
    "trainer/test_bf16_recipes.py": "e2e",
    "trainer/test_any_hf_model.py": "e2e",
    "trainer/test_any_hf_model.py::test_saved_model_loads_with_hybridflow_rules": "unit",
    "trainer/test_async.py": "e2e",
    "trainer/test_async.py::test_async_needs_its_own_generator_pool": "unit",
    "trainer/test_documented_keys_e2e.py": "e2e",
    "trainer/test_documented_keys_e2e.py::test_cuda_device_without_gpus_stops_before_the_workers": "dist",
    "trainer/test_dynamic_sampling.py::test_resume_continues_from_the_checkpointed_data_position": "e2e",
    "trainer/test_local_bind.py": "e2e",
    "trainer/test_lora_async.py": "e2e",
    "trainer/test_lora_async.py::test_generator_checks_each_push_and_a_lost_push_fails": "dist",
    "trainer/test_lora_async.py::test_payload_is_adapters_only_where_the_generator_takes_them": "unit",
    "trainer/test_lora_e2e.py": "e2e",
    "trainer/test_lora_resume.py": "e2e",
    "trainer/test_multi_turn_e2e.py": "e2e",
    "trainer/test_plugins.py": "e2e",
    "trainer/test_plugins.py::test_misspelled_plugin_fails_in_one_line_before_ray_starts": "dist",
    "trainer/test_plugins.py::test_plugin_file_that_raises_names_the_file": "unit",
    "trainer/test_plugins.py::test_user_driver_config_check_runs_at_load": "unit",
    "trainer/test_ppo_e2e.py": "e2e",
    "trainer/test_ray_job_submit.py": "e2e",
    "trainer/test_resume.py": "e2e",
    "trainer/test_run_dir.py::test_cli_refuses_another_recipe_in_a_directory_with_a_ppo_checkpoint": "dist",
    "trainer/test_run_dir.py::test_two_runs_into_one_directory_then_a_resume_after_an_interrupt": "e2e",
    "trainer/test_run_lock.py": "dist",
    "trainer/test_run_output.py": "e2e",
    "trainer/test_tool_quickstart.py": "e2e",
    "trainer/test_tool_quickstart.py::test_recipe_loads_with_the_tool_task_and_model": "unit",
    "trainer/test_uneven_batches.py": "dist",
    "trainer/test_uneven_batches.py::test_odd_sequence_count_is_refused_at_load": "unit",
    "trainer/test_uneven_batches.py::test_train_two_steps_with_n2_and_validate_odd_set": "e2e",
    "trainer/test_unread_in_loop.py::test_fit_stops_after_the_step_whose_unread_update_failed": "e2e",
    "trainer/test_worker_failure.py": "e2e",
    "trainer/test_vlm_e2e.py": "e2e",
    "training/test_metric_pooling.py": "dist",
    "training/test_bf16_resume.py": "dist",
    "training/test_cpu_attention_dtype.py::test_fsdp2_engine_switches_bf16_models_on_cpu_only": "dist",
    "training/test_fsdp2_kept_gathered.py": "dist",
    "training/test_lora_mixed_precision.py": "dist",
    "training/test_megatron_ep.py": "dist",
    "training/test_megatron_parity.py": "dist",
    "training/test_moe_fsdp2.py": "dist",
    "training/test_replicated_engine.py": "dist",
    "training/test_replicated_engine.py::test_autocast_computes_in_bf16_over_fp32_weights": "unit",
    "training/test_shared_prompt.py::test_actor_and_critic_equal_the_padded_path_on_two_ranks": "dist",
    "training/test_ulysses.py::test_ulysses_equals_sp1": "dist",
    "training/test_vlm_training.py::test_image_less_rank_fsdp2_two_ranks_equal_one_process": "dist",
    "utils/test_allocator.py": "dist",
    "utils/test_trackers.py::test_swanlab_offline_run_holds_the_jsonl_scalars_and_the_config": "dist",
    "utils/test_trackers.py::test_train_two_steps_every_tracker_reads_back_metrics_jsonl": "e2e",
    "workers/test_engine_plugin.py": "e2e",
    "workers/test_lora_critic.py": "dist",
    "workers/test_lora_vllm.py": "dist",
    "workers/test_lora_worker.py": "dist",
    "workers/test_packing.py::test_packed_equals_padded_logprobs_values_and_gradients_on_two_ranks": "dist",
    "workers/test_ref_follows_actor_dtype.py": "dist",
    "workers/test_ref_follows_actor_dtype.py::test_the_driver_logs_what_each_group_computes_in": "unit",
    "workers/test_reward_user_error.py": "dist",
    "workers/test_token_batches.py::test_ranks_with_different_micro_batch_counts_complete_and_apply_the_batch_gradient": "dist",
    "workers/test_update_split_invariance.py": "dist",
    "workers/test_update_split_invariance.py::test_filtering_changes_the_update": "unit",
}


class TierError(RuntimeError):
    """A test did what its tier does not allow."""


def tier_of(nodeid: str) -> str:
    """The tier of the test ``nodeid`` (``tests/x/test_y.py::test_z[param]`` or relative to ``tests/``)."""
    path, _, name = nodeid.partition("::")
    path = path.removeprefix("tests/")
    name = name.split("[")[0]
    keys = [k for k in TIERS if k == path or (name and k == f"{path}::{name}")
            or (name and k.startswith(f"{path}::") and name.startswith(k.split("::", 1)[1] + "::"))]
    return TIERS[max(keys, key=len)] if keys else "unit"


_state: dict = {"stack": [], "record": None}


@contextmanager
def running(context: str, tier: str) -> Iterator[None]:
    """Within this block, guarded actions are judged against ``tier`` and recorded under ``context`` (a test
    nodeid or ``fixture:NAME``)."""
    _state["stack"].append((context, tier))
    try:
        yield
    finally:
        _state["stack"].pop()


def current_tier() -> str:
    """The tier of the test now being set up or run (``e2e``, the most lenient, outside any)."""
    return _state["stack"][-1][1] if _state["stack"] else "e2e"


def _observe(level: str, what: str) -> None:
    """One guarded action of ``level``: noted for the fixtures that run it, then recorded, or refused when it is
    above the running test's tier."""
    if not _state["stack"]:
        return
    for context, _ in _state["stack"]:
        if context.startswith("fixture:"):
            name = context.removeprefix("fixture:")
            known = _fixture_levels.get(name, "unit")
            _fixture_levels[name] = max(known, level, key=LEVELS.index)
    record = _state["record"]
    if record is not None:
        with open(record, "a") as f:
            for context, _ in _state["stack"]:
                f.write(json.dumps({"context": context, "level": level, "what": what}) + "\n")
        return
    context, tier = _state["stack"][-1]
    if LEVELS.index(level) > LEVELS.index(tier):
        test = next((c for c, _ in reversed(_state["stack"]) if not c.startswith("fixture:")), context)
        _refuse(test, tier, level, what)


def _refuse(test: str, tier: str, level: str, what: str) -> None:
    path = test.partition("::")[0].removeprefix("tests/")
    raise TierError(f"{test} is in tier {tier!r} but {what} ({level}); name it in tests/tiers.py TIERS, "
                    f"e.g. {path!r}: {level!r}")


#: fixture name -> the highest level its set-up reached so far (a session fixture sets up once, for its first test)
_fixture_levels: dict[str, str] = {}


def check_fixtures(test: str, fixtures, tier: str) -> None:
    """Refuse a test whose fixtures (already set up, for it or an earlier test) did what is above ``tier``."""
    if _state["record"] is not None:
        return
    for name in fixtures:
        level = _fixture_levels.get(name, "unit")
        if LEVELS.index(level) > LEVELS.index(tier):
            _refuse(test, tier, level, f"uses fixture {name!r}, whose set-up reached {level}")


def _argv_level(args) -> Optional[tuple[str, str]]:
    """A Python child process (a CLI call, a script, ``ray``) is dist; anything else (git, a linter) is not
    guarded. Whether a child trains (e2e) is not seen from here: such tests are named e2e in ``TIERS``."""
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    names = {os.path.basename(a) for a in argv[:1]}
    if any("python" in n or n in ("hybridflow", "ray") for n in names) or argv[:1] == [sys.executable]:
        return "dist", f"starts a Python child process ({' '.join(argv)[:120]})"
    return None


def install() -> None:
    """Wrap the guarded actions (once per session); ``HYBRIDFLOW_TIER_RECORD`` switches to recording."""
    import ray

    from hybridflow.trainer.loop import TrainLoop

    _state["record"] = os.environ.get("HYBRIDFLOW_TIER_RECORD") or None
    ray_init, start, execute, fit, pty_fork = (ray.init, multiprocessing.process.BaseProcess.start,
                                               subprocess.Popen._execute_child, TrainLoop.fit, pty.fork)

    def guarded_ray_init(*args, **kwargs):
        _observe("dist", "starts Ray (ray.init)")
        return ray_init(*args, **kwargs)

    def guarded_start(self):
        _observe("dist", f"starts a process ({type(self).__name__})")
        return start(self)

    def guarded_execute(self, args, *rest, **kwargs):
        level = _argv_level(args)
        if level is not None:
            _observe(*level)
        return execute(self, args, *rest, **kwargs)

    def guarded_pty_fork():
        _observe("dist", "forks a process on a new terminal (pty.fork)")
        return pty_fork()

    def guarded_fit(self, *args, **kwargs):
        _observe("e2e", "runs a training (TrainLoop.fit)")
        return fit(self, *args, **kwargs)

    ray.init = guarded_ray_init
    multiprocessing.process.BaseProcess.start = guarded_start
    subprocess.Popen._execute_child = guarded_execute
    TrainLoop.fit = guarded_fit
    pty.fork = guarded_pty_fork
