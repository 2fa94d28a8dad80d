"""The vLLM engine's arguments are ``actor_rollout_ref.rollout`` keys (verl's names) declared by the vllm backend's
registration: they reach the rollout's config, become the ``vllm.LLM`` arguments of the same names, keep vLLM's
own GPU defaults (CUDA graphs on) and are range-checked at load."""

import importlib.util
import types

import pytest

from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.rollout.vllm_config import engine_kwargs
from hybridflow.workers.actor_worker import make_rollout_config

PREFIX = "actor_rollout_ref.rollout."
#: one non-default value per key a verl user tunes
SET = {"gpu_memory_utilization": 0.3, "enforce_eager": True, "free_cache_engine": False,
       "max_num_batched_tokens": 4096, "max_num_seqs": 7, "kv_cache_memory_bytes": 1 << 20,
       "enable_chunked_prefill": True, "enable_prefix_caching": False}


def _overrides(values: dict) -> list[str]:
    return [f"{PREFIX}{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def test_every_engine_key_reaches_the_rollout_config():
    cfg = load_config(None, _overrides(SET))
    rollout = make_rollout_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)
    assert {key: getattr(rollout, key) for key in SET} == SET


def test_set_keys_become_the_engine_arguments_of_the_same_names():
    rollout = make_rollout_config(load_config(None, _overrides(SET)).actor_rollout_ref.rollout, 8)
    for cpu in (False, True):  # a value the user set wins over the platform's default
        kwargs = engine_kwargs(rollout, cpu=cpu, longest=lambda: pytest.fail("not needed when the budget is set"))
        expected = {k: v for k, v in SET.items() if k != "free_cache_engine"}
        assert {k: kwargs[k] for k in expected} == expected
        assert kwargs["enable_sleep_mode"] is False  # free_cache_engine=false: the engine never sleeps


def test_gpu_defaults_leave_vllm_its_own_defaults():
    rollout = make_rollout_config(load_config(None).actor_rollout_ref.rollout, 8)
    kwargs = engine_kwargs(rollout, cpu=False, longest=lambda: pytest.fail("no CPU budget on GPU"))
    # CUDA graphs on, half the GPU (verl's default), sleep between phases; nothing else forced on vLLM
    assert kwargs == {"enforce_eager": False, "gpu_memory_utilization": 0.5, "enable_sleep_mode": True}


def test_cpu_defaults_are_what_vllm_cpu_needs(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    rollout = make_rollout_config(load_config(None).actor_rollout_ref.rollout, 8)
    kwargs = engine_kwargs(rollout, cpu=True, longest=lambda: 10_000)
    assert kwargs["enforce_eager"] is True and kwargs["enable_chunked_prefill"] is False
    assert kwargs["max_num_batched_tokens"] == 10_000  # one step holds the longest whole prompt (> 8192)
    assert kwargs["kv_cache_memory_bytes"] == 256 * 1024 * 1024
    assert engine_kwargs(rollout, cpu=True, longest=lambda: 100)["max_num_batched_tokens"] == 8192


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_rollout_builds_its_engine_with_the_section_keys(monkeypatch, tmp_path):
    """``VLLMRollout`` hands ``vllm.LLM`` the keys (a stand-in engine records them; no model is loaded)."""
    import vllm

    from hybridflow.rollout import VLLMRollout

    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            text_model = types.SimpleNamespace()  # hf_config of a text model: no image token
            model_config = types.SimpleNamespace(get_vocab_size=lambda: 64, hf_config=text_model)
            self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(model_config=model_config))

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    cfg = load_config(None, _overrides({"gpu_memory_utilization": 0.3, "enforce_eager": True, "max_num_seqs": 7}))
    rollout_cfg = make_rollout_config(cfg.actor_rollout_ref.rollout, 8)
    VLLMRollout(str(tmp_path), rollout_cfg, eos_token_id=1, pad_token_id=0, max_model_len=64)
    assert (seen["gpu_memory_utilization"], seen["enforce_eager"], seen["max_num_seqs"]) == (0.3, True, 7)


@pytest.mark.parametrize("override", [f"{PREFIX}gpu_memory_utilization=0", f"{PREFIX}gpu_memory_utilization=1.5",
                                      f"{PREFIX}kv_cache_memory_bytes=0", f"{PREFIX}max_num_seqs=0",
                                      f"{PREFIX}max_num_batched_tokens=-1", "reward_model.timeout_s=0",
                                      "trainer.call_timeout_s=-1"])
def test_out_of_range_values_are_config_errors(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(None, [override])


def test_a_misspelled_engine_key_gets_the_nearest_one():
    with pytest.raises(ConfigError, match=rf"did you mean {PREFIX}enforce_eager\?"):
        load_config(None, [f"{PREFIX}enforce_eagre=true"])
