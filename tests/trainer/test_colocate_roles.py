"""Which runs colocate their roles (``trainer.colocate_roles``), decided from the config alone (no Ray): the
quickstart's actor, critic and reward share processes; the switch turns it off; two megatron engines (process-wide
parallel state) on one pool keep processes of their own, one megatron engine next to fsdp2 roles does not."""

import logging

import pytest

from hybridflow.config import load_config
from hybridflow.trainer.setup import colocate_roles, resource_pool_spec, worker_roles


def _decide(recipe, *overrides):
    config = load_config(recipe, list(overrides))
    roles = worker_roles(config)
    _, mapping = resource_pool_spec(config)
    return colocate_roles(config, roles, {role: mapping[role] for role in roles})


def test_quickstart_colocates_unless_switched_off():
    assert _decide("quickstart") is True
    assert _decide("quickstart", "trainer.colocate_roles=false") is False


def test_two_megatron_engines_on_one_pool_stay_apart(caplog):
    pytest.importorskip("megatron.core")
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.setup"):
        assert _decide("megatron_quickstart") is False
    assert "['actor', 'critic'] on pool global_pool train with engines that keep process-wide state (megatron)" \
        in caplog.text


def test_one_megatron_engine_shares_its_process():
    pytest.importorskip("megatron.core")
    assert _decide("megatron_quickstart", "critic.strategy=fsdp2", "critic.megatron.pipeline_model_parallel_size=1") \
        is True
