"""``fsdp_config.reshard_after_forward``: explicit values, the ``auto`` size rule, and a clear error."""

import pytest
import torch

from hybridflow.distributed import fsdp
from hybridflow.distributed.fsdp import UNSHARDED_MEMORY_SHARE, resolve_reshard_after_forward


def _model(n_params: int) -> torch.nn.Module:
    return torch.nn.Linear(n_params, 1, bias=False)  # n_params fp32 weights = 4 * n_params bytes


@pytest.mark.parametrize("setting, expected", [("true", True), ("True", True), ("false", False), ("FALSE", False)])
def test_explicit_values_win_whatever_the_size(setting, expected):
    assert resolve_reshard_after_forward(setting, _model(8), "cpu", param_offload=False) is expected


def test_auto_keeps_gathered_weights_only_for_a_model_well_under_the_rank_memory(monkeypatch):
    memory = 16 * 4000  # bytes: the share is 4000 bytes = 1000 fp32 weights
    monkeypatch.setattr(fsdp, "rank_memory_bytes", lambda device: memory)
    assert UNSHARDED_MEMORY_SHARE * memory == 4000
    assert resolve_reshard_after_forward("auto", _model(1000), "cpu", param_offload=False) is False  # at the share
    assert resolve_reshard_after_forward("auto", _model(1001), "cpu", param_offload=False) is True  # above it
    # offloaded parameters must not stay gathered on the device
    assert resolve_reshard_after_forward("auto", _model(10), "cpu", param_offload=True) is True


def test_cpu_rank_memory_is_host_ram_over_the_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = fsdp.rank_memory_bytes("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert fsdp.rank_memory_bytes("cpu") == one // 4 and one > 0


def test_lora_keeps_zero3_under_auto_and_refuses_false():
    assert resolve_reshard_after_forward("auto", _model(8), "cpu", param_offload=False, lora=True) is True
    with pytest.raises(ValueError, match="reshard_after_forward=false is not supported with LoRA"):
        resolve_reshard_after_forward("false", _model(8), "cpu", param_offload=False, lora=True)


def test_other_values_name_the_key():
    with pytest.raises(ValueError, match="reshard_after_forward must be auto, true or false, got 'sometimes'"):
        resolve_reshard_after_forward("sometimes", _model(8), "cpu", param_offload=False)
