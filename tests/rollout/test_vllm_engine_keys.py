"""The vLLM engine's memory and compile settings are config keys (verl's names) that reach the rollout's config."""

import pytest

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.workers.actor_worker import make_rollout_config

PREFIX = "actor_rollout_ref.rollout."


def test_engine_keys_reach_the_rollout_config():
    cfg = load_config(None, [f"{PREFIX}gpu_memory_utilization=0.3", f"{PREFIX}enforce_eager=false",
                             f"{PREFIX}kv_cache_memory_bytes=1048576"])
    rollout = make_rollout_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)
    assert (rollout.gpu_memory_utilization, rollout.enforce_eager, rollout.kv_cache_memory_bytes) == (0.3, False,
                                                                                                      1 << 20)


def test_defaults_are_the_engines_former_ones():
    cfg = load_config(None)
    rollout = make_rollout_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)
    # what VLLMRollout used when the keys did not exist: 0.5 of the GPU, eager, KV cache sized by the fraction
    assert (rollout.gpu_memory_utilization, rollout.enforce_eager, rollout.kv_cache_memory_bytes) == (0.5, True, None)


@pytest.mark.parametrize("override", [f"{PREFIX}gpu_memory_utilization=0", f"{PREFIX}gpu_memory_utilization=1.5",
                                      f"{PREFIX}kv_cache_memory_bytes=0", "reward_model.timeout_s=0",
                                      "trainer.call_timeout_s=-1"])
def test_out_of_range_values_are_config_errors(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(None, [override])
